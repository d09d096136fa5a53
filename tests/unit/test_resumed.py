"""What a resume says it changes: the checkpoint's config against this run's, key by key, and its line."""

from __future__ import annotations

from ddp_cli.train.resumed import Resumed, config_changes


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
