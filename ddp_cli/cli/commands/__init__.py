"""What each command does, without Typer: resolve inputs, check them (preflight), launch workers.
May import the product below cli/ and, in cli/, the kit, preflight and plan; never the Typer apps nor bench.
"""
