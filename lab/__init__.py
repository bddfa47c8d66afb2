"""What researchers and benchmarks use on top of the product.

The demo, the experiment grid and its merge, typed results, plots, progress display,
fleet and engine benchmarks, the private-broker helper, the in-process fleet harness and
the protocol's vector generator. Nothing in ``protocol``, ``zo``, ``policies``, ``daemon``
or ``firmware`` imports this package.
"""
