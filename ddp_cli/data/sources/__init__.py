"""What a data set contains: a reader per layout, each ending in the index table; the demo; predict's inputs.
May import data.fetch and the foundations (errors, io, userfiles)."""
