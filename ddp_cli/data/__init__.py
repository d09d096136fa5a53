"""Data: from storage to batches, in four rooms layered among themselves: fetch, sources, pipeline, pack.
May import config and the foundations (errors, io, userfiles); never distributed, models, observe or above."""
