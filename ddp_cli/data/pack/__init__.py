"""Writing shards: `ddp datasets pack` (local or S3) and `ddp datasets index` (webdataset's tars).
May import data's other rooms (fetch, sources, pipeline) and the foundations."""
