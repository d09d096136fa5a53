"""From rows to batches: sampler, decoding, transforms, augmentation, loaders, `data.workers = "auto"`, check.
May import data.sources, data.fetch, config and the foundations."""
