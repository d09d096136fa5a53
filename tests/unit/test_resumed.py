"""What a resume says it changes: the checkpoint's config against this run's, key by key, and its line."""

from __future__ import annotations

from ddp_cli.config import config_from_dict
from ddp_cli.config.resolve import Facts, resolve
from ddp_cli.train.checkpoint import migrate
from ddp_cli.train.resumed import Resumed, config_changes, resumed


def test_config_changes_names_every_dotted_key_that_differs_and_only_those():
    trained = {"train": {"epochs": 8, "precision": "bf16"}, "data": {"ramp_epochs": [3.2, 8.0], "mean": None},
               "model": {"source": {"revision": "a"}}}
    now = {"train": {"epochs": 12, "precision": "bf16"}, "data": {"ramp_epochs": [4.8, 12.0], "mean": None},
           "model": {"source": {"revision": "b"}, "weights": "x.pt"}}
    assert config_changes(trained, now) == {
        "train.epochs": (8, 12), "data.ramp_epochs": ([3.2, 8.0], [4.8, 12.0]),
        "model.source.revision": ("a", "b"), "model.weights": (None, "x.pt")}
    assert config_changes(now, now) == {}


def resume(**fields) -> Resumed:
    base = dict(checkpoint="run/checkpoints/step-000000176.pt", epochs_done=8, step=176, schedule_step=176,
                epochs=12, changes={"train.epochs": (8, 12)}, lr=(1e-05, 0.027), train_size=(32, 32))
    return Resumed(**{**base, **fields})


def test_the_line_names_the_checkpoint_the_step_each_change_the_next_lr_and_a_changed_crop():
    assert resume().line() == ("resumed from run/checkpoints/step-000000176.pt (epoch 9 of 12, step 176): "
                               "train.epochs 8 -> 12; LR at the next step 1e-05 -> 0.027")
    assert resume(train_size=(32, 24)).line().endswith("; train crop of epoch 9 32 -> 24")
    assert resume(changes={}, lr=(0.01, 0.01)).line().endswith("(epoch 9 of 12, step 176), as the run was")


def test_a_finished_run_says_there_is_nothing_to_train_and_how_to_train_on():
    done = resume(epochs=8, train_size=None)
    assert done.finished and not resume().finished
    assert done.line() == ("run/checkpoints/step-000000176.pt has trained 8 epochs and train.epochs is 8: "
                           "nothing to train, result.json left as it was; to train on, resume with "
                           "--set train.epochs=N (N > 8)")
    assert done.as_dict()["finished"] and resume().as_dict()["changes"] == {"train.epochs": [8, 12]}


def test_a_run_from_before_the_ramp_step_goes_on_in_its_steps_and_says_nothing_changed():
    """A checkpoint whose config predates data.ramp_step (migrated: 32 px) against this run's derived
    step (8 px at 64): `resumed`, which the dry run's plan and the Trainer share, reconciles first, so
    the plan says what the workers do: no ramp_step change, the epoch's crop as it trained."""
    cfg = resolve(config_from_dict({"data": {"image_size": 64}, "train": {"epochs": 30}}), Facts())
    saved = migrate({"rng": [{}], "epoch": 9, "step": 90,
                     "config": cfg.model_dump(mode="json") | {
                         "data": {k: v for k, v in cfg.model_dump(mode="json")["data"].items()
                                  if k != "ramp_step"}}})
    said = resumed("run/old.pt", saved, cfg, 0.1, 90)
    assert "data.ramp_step" not in said.changes
    # epoch 9 of the ramp [3, 18] from 32 px: 32 + 32 * 6/15 = 44.8, 32 in 32 px steps (48 in the rule's 8)
    assert said.train_size == (32, 32) and cfg.data.ramp_step == 8
