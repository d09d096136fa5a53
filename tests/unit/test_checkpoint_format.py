"""Checkpoint format versions: each older format, as the files of its time held it, comes out of
`migrate` in the current one, and every save says its version."""

from __future__ import annotations

import pytest
import torch

from ddp_cli.config import RunConfig
from ddp_cli.config.trained_before import TRAINED_BEFORE
from ddp_cli.errors import ConfigError, DataError
from ddp_cli.train.checkpoint import (
    FORMAT_VERSION,
    RunState,
    format_version,
    load_checkpoint,
    migrate,
    save_checkpoint,
)
from ddp_cli.train.schedules import resume_schedule

CONFIG = RunConfig.model_validate({"data": {"dataset": "demo", "batch_size": 4}, "train": {"grad_accum": 2}})
CLASSES = ["n01", "n02"]


def written_at(version: int) -> dict:
    """A checkpoint of two ranks, three steps into epoch 2, with the fields its version's files held."""
    state = {"format": 1, "epoch": 1, "step": 13, "step_in_epoch": 3, "running": [6.0, 3.0],
             "rng": [{"torch": torch.zeros(2)}, {"torch": torch.ones(2)}], "model": {"w": torch.ones(2)},
             "config": CONFIG.model_dump(mode="json"), "classes": CLASSES, "dataset": {"name": "demo"}}
    if version >= 1:  # 2026-11-23: the global batch and the epoch's position in images
        state.update(global_batch=16, samples_in_epoch=48)
    if version >= 2:  # every rank's running loss, the world size of each segment
        state.update(running=[[6.0, 3.0], [5.0, 3.0]], world_sizes=[2])
    if version >= 3:  # class descriptions, the epoch's sampler layout
        state.update(descriptions=["tench", "goldfish"], epoch_layout=8)
    return state


@pytest.mark.parametrize("version", [0, 1, 2, 3])
def test_files_without_a_version_are_read_off_what_they_hold(version):
    assert format_version(written_at(version)) == version
    assert format_version({**written_at(0), "format_version": 7}) == 7
    assert format_version({"descriptions": CLASSES}) == format_version({"epoch_layout": 8}) == 3  # either one


def test_version_0_gains_the_global_batch_and_position_from_its_own_config_and_world():
    state = migrate(written_at(0))
    assert state["global_batch"] == CONFIG.global_batch(2) == 16  # 2 ranks x batch 4 x 2 micro-steps
    assert state["samples_in_epoch"] == 3 * 16
    assert state["running"] == [[6.0, 3.0], [6.0, 3.0]]  # the writer's, which every rank resumed from
    assert state["world_sizes"] == [2] and state["descriptions"] == CLASSES
    assert state["format_version"] == FORMAT_VERSION


def test_version_0_without_a_position_starts_its_epoch_and_a_bad_config_names_the_file():
    old = {k: v for k, v in written_at(0).items() if k != "step_in_epoch"}
    assert migrate(old)["samples_in_epoch"] == 0
    with pytest.raises(ConfigError, match=r"^run/old\.pt: bogus: unknown key"):
        migrate({**old, "config": {"bogus": 1}}, "run/old.pt")


def test_version_1_keeps_its_position_and_gives_every_rank_the_writers_running_loss():
    state = migrate({**written_at(1), "samples_in_epoch": 40})  # what the file says wins
    assert (state["global_batch"], state["samples_in_epoch"]) == (16, 40)
    assert state["running"] == [[6.0, 3.0], [6.0, 3.0]] and state["world_sizes"] == [2]
    assert state["descriptions"] == CLASSES
    idle = {k: v for k, v in written_at(1).items() if k != "running"}  # saved before any step's loss
    assert migrate(idle)["running"] == []  # not one empty entry per rank: running_of gives (0, 0)


def test_version_2_gains_descriptions_and_nothing_else_changes():
    old = written_at(2)
    state = migrate(old)
    assert state["descriptions"] == CLASSES
    assert {k: v for k, v in state.items() if k not in ("descriptions", "format_version")} == old


def test_a_config_from_before_the_ramp_step_key_trained_in_32_px_steps():
    """Progressive resizing grew its crops in 32 px steps before data.ramp_step: a checkpoint whose config
    lacks the key says so, so that its resume keeps them (`config.resolve.resume`); one that has the key
    keeps its own, and a bare set of weights gains nothing."""
    old = written_at(3)
    old["config"] = {**old["config"], "data": {k: v for k, v in old["config"]["data"].items()
                                               if k != "ramp_step"}}
    assert migrate(old)["config"]["data"]["ramp_step"] == TRAINED_BEFORE["data.ramp_step"] == 32
    current = written_at(3)
    current["config"]["data"]["ramp_step"] = 16
    assert migrate(current)["config"]["data"]["ramp_step"] == 16
    assert "ramp_step" not in migrate({"classes": CLASSES, "config": {"data": {}}})["config"]["data"]


def test_a_config_from_before_the_ramps_end_key_rose_to_image_size():
    """Before data.end_image_size a ramp rose to image_size: a checkpoint whose config has a ramp
    (min_image_size) and lacks the key gets its image_size; one without a ramp, or with the key, keeps
    what it says."""
    old = written_at(3)
    data = {k: v for k, v in old["config"]["data"].items() if k != "end_image_size"}
    old["config"] = {**old["config"], "data": {**data, "image_size": 112, "min_image_size": 56}}
    assert migrate(old)["config"]["data"]["end_image_size"] == 112
    flat = written_at(3)
    flat["config"] = {**flat["config"], "data": {**data, "min_image_size": None}}
    assert "end_image_size" not in migrate(flat)["config"]["data"]
    current = written_at(3)
    current["config"]["data"].update(image_size=112, min_image_size=56, end_image_size=96)
    assert migrate(current)["config"]["data"]["end_image_size"] == 96


def test_the_current_version_passes_through_and_a_newer_one_is_refused():
    current = {**written_at(3), "format_version": FORMAT_VERSION}
    assert migrate(current) == current
    with pytest.raises(DataError, match="newer ddp .*format 4"):
        migrate({**current, "format_version": FORMAT_VERSION + 1}, "run/last.pt")
    with pytest.raises(DataError, match=r"^checkpoint: written by a newer ddp"):  # no path given
        migrate({**current, "format_version": FORMAT_VERSION + 1})


def test_loading_names_the_file_in_migrations_errors(tmp_path):
    path = tmp_path / "new.pt"
    torch.save({**written_at(3), "format_version": FORMAT_VERSION + 1}, path)
    with pytest.raises(DataError, match=f"^{path}: written by a newer ddp"):
        load_checkpoint(path)


@pytest.mark.parametrize(("field", "value", "kind"),
                         [("classes", "n01", "str"), ("global_batch", True, "bool")])
def test_a_field_of_the_wrong_type_is_refused_by_name_before_migrating(tmp_path, field, value, kind):
    """A bool is an int to isinstance, so it is refused on its own; either way the line names the field."""
    path = tmp_path / "odd.pt"
    save_checkpoint({**written_at(3), field: value}, path)
    with pytest.raises(DataError) as refused:
        load_checkpoint(path)
    assert str(refused.value) == (f"{path}: not a ddp checkpoint ({field} is a {kind}); use another "
                                  "checkpoint (--resume auto picks a valid one)")


@pytest.mark.parametrize("running", [[[1.0, 2.0], [3.0]], [[1.0, "2"]], [[1.0, True]], [1.0, 2.0]],
                         ids=["ragged", "a string", "a bool", "not rows"])
def test_running_sums_that_are_not_one_row_per_rank_are_refused_by_name(tmp_path, running):
    """A hand-made file: resuming would otherwise end in a ValueError (exit 1) when the sums are spread."""
    path = tmp_path / "odd.pt"
    save_checkpoint({**written_at(3), "running": running}, path)
    with pytest.raises(DataError, match=r"^.*odd\.pt: not a ddp checkpoint \(running is not a row of sums "
                                        r"per rank, all of one width\); use another checkpoint"):
        load_checkpoint(path)
    save_checkpoint({**written_at(3), "running": [[1.0, 2], [3.0, 4]]}, path)  # ints and floats, as written
    assert load_checkpoint(path)["running"] == [[1.0, 2], [3.0, 4]]


def test_a_file_without_training_state_keeps_none():
    state = migrate({"format": 1, "classes": CLASSES, "config": {}})  # e.g. what a test hands validate
    assert state == {"format": 1, "classes": CLASSES, "config": {}, "descriptions": CLASSES,
                     "format_version": FORMAT_VERSION}


def test_a_migrated_file_restores_into_the_run_state_and_saves_say_their_version(tmp_path):
    path = tmp_path / "old.pt"
    torch.save(written_at(0), path)  # as ddp wrote it then: no version, no manifest
    state = load_checkpoint(path)
    progress = RunState()
    progress.load_state_dict(state)
    assert (progress.global_batch, progress.samples_in_epoch, progress.world_sizes) == (16, 48, [2])
    assert progress.running_of(1, 2) == [6.0, 3.0]
    assert progress.running_of(0, 1) == [12.0, 6.0] and progress.running_of(1, 3) == [0.0, 0.0]
    save_checkpoint(state, tmp_path / "new.pt")
    assert torch.load(tmp_path / "new.pt", weights_only=True)["format_version"] == FORMAT_VERSION


def test_resume_schedule_rescales_the_peak_and_continues_at_the_step():
    params = [torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))]
    optimizer = torch.optim.SGD([{"params": params[:1], "lr": 0.4}, {"params": params[1:], "lr": 0.2}])
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (1 + step))
    resume_schedule(scheduler, 0.5, step=3)
    assert scheduler.base_lrs == [0.2, 0.1] and scheduler.last_epoch == 3
    assert [g["initial_lr"] for g in optimizer.param_groups] == [0.2, 0.1]
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([0.05, 0.025])
    optimizer.step()
    scheduler.step()  # and the schedule goes on from there
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([0.04, 0.02])


def test_a_run_from_before_ema_bn_epochs_is_migrated_to_say_it_trained_without():
    """A training checkpoint whose config has no train.ema_bn_epochs was written before the key: its run
    never recomputed the EMA's statistics, and its migrated config says so (0); one that has the key, or a
    bare set of weights, keeps what it holds."""
    old = {"format_version": 3, "rng": [None], "config": {"train": {"epochs": 8}}}
    assert migrate(old)["config"]["train"] == {"epochs": 8, "ema_bn_epochs": 0}
    assert old["config"]["train"] == {"epochs": 8}  # the loaded state is not edited in place
    new = {"format_version": 3, "rng": [None], "config": {"train": {"epochs": 8, "ema_bn_epochs": 2}}}
    assert migrate(new)["config"]["train"]["ema_bn_epochs"] == 2
    weights = {"format_version": 3, "config": {"train": {"epochs": 8}}}
    assert "ema_bn_epochs" not in migrate(weights)["config"]["train"]
