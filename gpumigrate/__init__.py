"""gpumigrate: move PyTorch training scripts to any device, to DDP and to mixed precision."""

__version__ = "0.1.0"
