"""How long an STM32N6 board takes: NPU forward passes and serial transfers.

The virtual board sleeps for these times so that a simulated fleet has the timing of a
real one. The NPU figure is anchored on one published measurement rather than on the
peak rate: the Neural-ART NPU peaks at 600 GOPS (1 GHz), but MobileNetV2-0.35 at
128x128 int8 takes about 6.35 ms per inference on the STM32N6570-DK, far from peak,
because small layers are bound by memory traffic and epoch set-up. We therefore scale
that measured time by MACs, and add a fixed per-inference overhead so that tiny models
do not come out unrealistically fast.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

__all__ = [
    "DK_BAUD",
    "MOBILENETV2_035_128_MACS",
    "MOBILENETV2_035_128_SECONDS",
    "NpuLatencyModel",
    "serial_seconds",
]

# Multiply-accumulates of MobileNetV2 (width 0.35, 128x128x3 input, 1000 classes),
# as counted by qsched.zo.zoo's model_summary for that configuration.
MOBILENETV2_035_128_MACS: Final = 20_220_672
MOBILENETV2_035_128_SECONDS: Final = 6.35e-3
NPU_PEAK_OPS_PER_SECOND: Final = 600e9
# Per-inference set-up (epoch programming, cache maintenance) seen on small networks.
NPU_FIXED_OVERHEAD_SECONDS: Final = 50e-6
# The ST-LINK virtual COM port of the STM32N6570-DK.
DK_BAUD: Final = 921_600
# 8N1 framing: a start and a stop bit around every byte.
BITS_PER_SERIAL_BYTE: Final = 10


@dataclass(frozen=True)
class NpuLatencyModel:
    """Forward-pass time of an int8 model on the Neural-ART NPU, linear in MACs.

    Args:
        reference_macs: MACs of the model whose time was measured.
        reference_seconds: its measured time per inference.
        overhead_seconds: fixed time added to every inference.
    """

    reference_macs: int = MOBILENETV2_035_128_MACS
    reference_seconds: float = MOBILENETV2_035_128_SECONDS
    overhead_seconds: float = NPU_FIXED_OVERHEAD_SECONDS

    def forward_seconds(self, macs: int, batch: int = 1) -> float:
        """Seconds for ``batch`` inferences of a model of ``macs`` MACs each."""
        if macs < 0 or batch < 0:
            raise ValueError("macs and batch must be non-negative")
        per_mac = (self.reference_seconds - self.overhead_seconds) / self.reference_macs
        return batch * (self.overhead_seconds + per_mac * macs)

    def effective_ops_per_second(self, macs: int) -> float:
        """Achieved operations per second (2 per MAC) for a model of ``macs`` MACs."""
        return 2 * macs / self.forward_seconds(macs)

    def utilisation(self, macs: int) -> float:
        """Fraction of the NPU's 600 GOPS peak achieved."""
        return self.effective_ops_per_second(macs) / NPU_PEAK_OPS_PER_SECOND


def serial_seconds(payload_bytes: int, baud: int = DK_BAUD) -> float:
    """Seconds to move ``payload_bytes`` over a UART at ``baud`` with 8N1 framing."""
    if baud <= 0:
        raise ValueError(f"baud must be positive, got {baud}")
    return payload_bytes * BITS_PER_SERIAL_BYTE / baud
