"""flotilla: PyTorch-native training on heterogeneous, transient clusters.

Layers (bottom to top, a layer imports only layers below it) are described in
``docs/architecture.md``.  ``flotilla.sim`` must import without torch.
"""

__version__ = "0.1.0"
