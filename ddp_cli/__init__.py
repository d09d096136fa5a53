"""ddp: train image classifiers data-parallel on torch.distributed from one TOML file."""

__version__ = "0.1.0"
