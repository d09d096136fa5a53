"""ddp: train image classifiers data-parallel on torch.distributed from one TOML file.
Holds the foundations at its top and the rooms as packages (tests/unit/test_layers.py: who imports whom);
this file imports nothing.
"""

__version__ = "0.1.0"
