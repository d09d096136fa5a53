"""Primitives of a world of ranks: process groups, GPUs, gradient reduction, stop signals, the heartbeat.
May import config and errors only: it knows nothing of data, models or training."""
