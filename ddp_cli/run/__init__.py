"""Processes: the launcher (elastic agent), the job folder, the worker's life, training and inference jobs.
May import train, registry and all below them (data, models.zoo, distributed, observe, config); not cli/.

Also the run dir's mirror to a bucket, and the loopback gloo harness that benches and tests share."""
