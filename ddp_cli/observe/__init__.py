"""What a person sees: the console, metrics sinks, start-up timing, `ddp report`'s pictures.
May import config and the foundations (errors, io, userfiles)."""
