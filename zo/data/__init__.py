"""Built-in data sets and the pretrained model shipped with qsched (see PROVENANCE.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Final

__all__ = ["DATA_DIR", "MOBILENETV2_EUROSAT_C0_4", "RESNET8_CIFAR10", "RESNET18_EUROSAT_C0_4"]

DATA_DIR: Final = Path(__file__).parent
# MLPerf Tiny's int8 ResNet-8 for CIFAR-10, as TensorFlow's converter wrote it: the real
# model a user brings (Apache-2.0, notice in PROVENANCE.md).
RESNET8_CIFAR10: Final = DATA_DIR / "mlperftiny_resnet8_cifar10_int8.tflite"
# ResNet-18 topology at width 0.25, pretrained here on EuroSAT classes 0-4 by
# ``qsched pretrain`` (its command and accuracies in the .json beside it).
RESNET18_EUROSAT_C0_4: Final = DATA_DIR / "resnet18_w0.25_eurosat32_c0-4_int8.tflite"
# MobileNetV2 at width 0.35, pretrained the same way (the paper's other family).
MOBILENETV2_EUROSAT_C0_4: Final = DATA_DIR / "mobilenetv2_w0.35_eurosat32_c0-4_int8.tflite"
