"""Processes: the launcher (elastic agent), the job folder, the worker's life, training and inference jobs.
May import train, data.registry and all below them (data, models, distributed, observe, config); not cli/.

Also the run dir's mirror to a bucket, and the loopback gloo harness that benches and tests share."""
