"""Processes: the launcher (elastic agent), the job folder handed to workers, the worker entry point,
and the loopback gloo harness benches and tests share."""
