"""Per-rank logs: where torch's agent is told to put each worker's streams (no process started;
tests/e2e/test_cli_train.py and test_launch.py read real ones, forked and spawned)."""

from __future__ import annotations

from string import Template

from ddp_cli.config import DistributedConfig
from ddp_cli.run import launch
from ddp_cli.run.logs import RankLogs


def envs(*ranks: int, restart: int = 0) -> dict[int, dict[str, str]]:
    return {local: {"RANK": str(rank), "TORCHELASTIC_RESTART_COUNT": str(restart)}
            for local, rank in enumerate(ranks)}


def test_files_are_named_by_global_rank_and_every_stream_is_teed(tmp_path):
    workers = envs(4, 5)  # node 2 of a 2-per-node job
    logs = tmp_path / "logs"
    dest = RankLogs(logs).reify(workers)
    assert dest.stderrs == {0: str(logs / "rank4.stderr.log"), 1: str(logs / "rank5.stderr.log")}
    assert dest.stdouts[1] == str(logs / "rank5.stdout.log")
    assert dest.tee_stdouts == dest.stdouts and dest.tee_stderrs == dest.stderrs  # the console keeps them
    assert workers[1]["TORCHELASTIC_ERROR_FILE"] == dest.error_files[1] == str(logs / "rank5.error.json")


def test_on_a_terminal_rank_0s_stderr_stays_on_it_for_the_live_progress(tmp_path):
    dest = RankLogs(tmp_path, live_console=True).reify(envs(0, 1))
    assert dest.stderrs == {0: "", 1: str(tmp_path / "rank1.stderr.log")}  # "": not redirected
    assert 0 not in dest.tee_stderrs and dest.stdouts[0] == str(tmp_path / "rank0.stdout.log")


def test_a_restart_gets_files_of_its_own(tmp_path):
    dest = RankLogs(tmp_path).reify(envs(0, restart=2))
    assert dest.stderrs[0] == str(tmp_path / "rank0.restart2.stderr.log")


def test_an_earlier_launch_is_moved_aside_never_overwritten(tmp_path):
    """A resume into the same run dir: the failure being resumed from stays readable, and its error
    file is not read back as this launch's."""
    (tmp_path / "rank0.stderr.log").write_text("first\n")
    (tmp_path / "rank0.error.json").write_text("{}")
    RankLogs(tmp_path).reify(envs(0))
    (tmp_path / "rank0.stderr.log").write_text("second\n")  # what the second launch's worker wrote
    RankLogs(tmp_path).reify(envs(0))
    assert (tmp_path / "rank0.stderr.1.log").read_text() == "first\n"
    assert (tmp_path / "rank0.stderr.2.log").read_text() == "second\n"
    assert not (tmp_path / "rank0.stderr.log").exists() and (tmp_path / "rank0.error.1.json").exists()


def test_launch_keeps_logs_in_the_job_folder_with_an_unprefixed_console(tmp_path, monkeypatch):
    seen = {}

    def elastic_launch(config, entrypoint):
        seen["config"] = config
        return lambda *args: None

    monkeypatch.setattr(launch, "elastic_launch", elastic_launch)
    monkeypatch.setenv(launch.LAUNCHED, "1")
    launch.launch(tmp_path, 2, launch.LaunchOptions(), DistributedConfig())
    config = seen["config"]
    assert config.logs_specs.root_log_dir == str(tmp_path / "logs")
    prefix = Template(config.log_line_prefix_template).safe_substitute(
        role_name=config.role, rank=5, local_rank=1, hostname="node3")
    assert config.log_line_prefix_template and prefix == ""  # torch's default header would be "[default1]:"
