"""Data: from storage to batches, in four rooms layered among themselves: fetch, sources, pipeline, pack.
May import config and the foundations (errors, io, userfiles); never distributed, models, observe or above.

Above the rooms: `registry` (data.toml: the data sets by name, resolved to fsspec roots) and
`index_build` (a run's data set and index table, built in a forked child while the launcher imports
torch). The pipeline and the rooms below it never read the registry.
"""
