"""`validate` deepened and `predict`, on a trained demo checkpoint (`trained_demo`).

validate's top-k, per-class counts and confusion matrix are checked against an
independent computation on the probabilities it saved (--predictions), at two
world sizes; predict on a folder of the val images agrees with validate's top-1.
"""

from __future__ import annotations

import csv
import json
import shutil

import numpy as np
import pytest
import torch
from conftest import last_json, run_ddp

pytestmark = pytest.mark.slow
SPLIT = 359  # the demo's val images


def read_csv(path) -> list[list[str]]:
    with open(path, newline="") as f:
        return list(csv.reader(f))


@pytest.fixture(scope="module")
def validated(trained_demo, tmp_path_factory):
    """Two validations of last.pt: 2 workers with every output, 1 worker with the confusion only."""
    out = tmp_path_factory.mktemp("validated")
    ckpt = str(trained_demo / "checkpoints" / "last.pt")
    two = last_json(run_ddp("validate", "--checkpoint", ckpt, "--nproc-per-node", "2", "--topk", "1,5,10",
                            "--per-class", "--confusion", str(out / "cm2.csv"), "--predictions",
                            str(out / "p2.csv"), "--json"))
    one = last_json(run_ddp("validate", "--checkpoint", ckpt, "--topk", "10,1", "--confusion",
                            str(out / "cm1.csv"), "--json"))
    return {"two": two, "one": one, "out": out, "state": torch.load(ckpt, weights_only=True)}


def matrix(path) -> np.ndarray:
    rows = read_csv(path)
    return np.array([[int(c) for c in row[2:]] for row in rows[1:]])


def test_numbers_are_exact_at_any_world_size_and_match_training(validated):
    two, one, state = validated["two"], validated["one"], validated["state"]
    assert two["world_size"] == 2 and one["world_size"] == 1
    assert two["images"] == one["images"] == SPLIT
    for key in ("top1", "top5", "top10"):
        assert two[key] == one[key], key
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-6)
    assert two["top1"] == state["final"]["top1"]  # training validated the same weights
    assert 0.5 < two["top1"] < two["top5"] <= two["top10"] == 1.0  # 10 classes: top-10 is everything
    assert np.array_equal(matrix(validated["out"] / "cm2.csv"), matrix(validated["out"] / "cm1.csv"))


def test_per_class_and_confusion_agree_with_the_saved_probabilities(validated):
    two, out = validated["two"], validated["out"]
    rows = read_csv(out / "p2.csv")
    header, rows = rows[0], rows[1:]
    assert header[:6] == ["path", "label", "synset", "top1_index", "top1_synset", "top1_probability"]
    assert len(rows) == SPLIT and len({r[0] for r in rows}) == SPLIT
    labels = np.array([int(r[1]) for r in rows])
    classes = np.array([[int(r[3 + 3 * j]) for j in range(10)] for r in rows])  # all 10: a full ranking
    probs = np.array([[float(r[5 + 3 * j]) for j in range(10)] for r in rows])
    assert (np.diff(probs, axis=1) <= 0).all() and np.allclose(probs.sum(axis=1), 1, atol=1e-4)
    rank = (classes == labels[:, None]).argmax(axis=1)  # where the label stands in each ranking
    for k in (1, 5, 10):
        assert two[f"top{k}"] == pytest.approx((rank < k).mean(), abs=1e-12), k
    expected = np.zeros((10, 10), dtype=np.int64)
    np.add.at(expected, (labels, classes[:, 0]), 1)
    cm = matrix(out / "cm2.csv")
    assert np.array_equal(cm, expected)
    assert cm.sum() == SPLIT and np.trace(cm) / cm.sum() == pytest.approx(two["top1"])
    nll = -np.log(probs[np.arange(SPLIT), rank])
    assert two["loss"] == pytest.approx(nll.mean(), rel=1e-4)
    per_class = two["per_class"]
    assert [c["index"] for c in per_class] == list(range(10))
    assert sum(c["images"] for c in per_class) == SPLIT
    assert [c["images"] for c in per_class] == cm.sum(axis=1).tolist()
    assert [c["top1"] for c in per_class] == pytest.approx((np.diag(cm) / cm.sum(axis=1)).tolist())
    assert per_class[3]["description"] == "digit three"


def test_saved_probabilities_belong_to_the_files_they_name(validated, trained_demo):
    """Two rows recomputed from their image files with the checkpoint's weights."""
    from ddp_cli.data.pipeline.images import open_image
    from ddp_cli.data.pipeline.transforms import ValTransform, to_model_input
    from ddp_cli.train.checkpoint_model import load_trained

    trained = load_trained(trained_demo / "checkpoints" / "last.pt")
    model, data = trained.build(), trained.cfg.data
    rows = read_csv(validated["out"] / "p2.csv")[1:]
    for row in (rows[0], rows[200]):
        with open(row[0], "rb") as f:
            pixels = ValTransform(data.image_size, data.val_resize)(open_image(f.read()))
        with torch.no_grad():
            p = model(to_model_input(pixels[None], torch.device("cpu"), False)).softmax(1)[0]
        assert [float(row[5 + 3 * j]) for j in range(10)] == pytest.approx(
            p[[int(row[3 + 3 * j]) for j in range(10)]].tolist(), abs=1e-5)


def test_per_class_leaves_an_evaluation_for_ddp_report(validated, trained_demo):
    saved = json.loads((trained_demo / "evaluations" / "last-model.json").read_text())
    assert validated["two"]["evaluation"] == str(trained_demo / "evaluations" / "last-model.json")
    assert saved["source"] == "validate last.pt --weights model" and saved["images"] == SPLIT
    assert saved["per_class"] == validated["two"]["per_class"]
    assert np.array_equal(np.array(saved["confusion"]), matrix(validated["out"] / "cm2.csv"))
    training = json.loads((trained_demo / "evaluation.json").read_text())
    assert training["source"] == "train epoch 3" and training["confusion"] == saved["confusion"]


def answers(result) -> tuple[list[dict], dict | None]:
    lines = [json.loads(line) for line in result.stdout.strip().splitlines()]
    return ([x for x in lines if "path" in x], lines[-1] if "exit_code" in lines[-1] else None)


def test_predict_a_folder_agrees_with_validate_and_reports_a_bad_image(validated, trained_demo, demo_registry,
                                                                       demo_root, tmp_path):
    folder = tmp_path / "photos"
    shutil.copytree(demo_root / "ILSVRC" / "Data" / "CLS-LOC" / "val", folder)
    (folder / "broken.JPEG").write_bytes((folder / "ILSVRC2012_val_00000001.JPEG").read_bytes()[:40])
    ckpt = str(trained_demo / "checkpoints" / "last.pt")
    loose = run_ddp("predict", "--checkpoint", ckpt, str(folder), "--nproc-per-node", "2", "--topk", "1",
                    "--json")
    assert loose.returncode == 3, loose.stderr[-2000:]
    found, failure = answers(loose)
    assert len(found) == SPLIT + 1 and failure["exit_code"] == 3 and "broken.JPEG" in failure["error"]
    assert [x["path"] for x in found] == sorted(x["path"] for x in found)  # a folder is read in order
    bad = [x for x in found if "error" in x]
    assert [x["path"] for x in bad] == [str(folder / "broken.JPEG")] and "truncated" in bad[0]["error"]
    assert "1 of 360 images could not be predicted" in loose.stderr

    split = run_ddp("predict", "--checkpoint", ckpt, "--dataset", "demo", "--registry", str(demo_registry),
                    "--split", "val", "--topk", "3", "--weights", "ema", "--json")
    labelled, failure = answers(split)
    assert split.returncode == 0 and failure is None and len(labelled) == SPLIT
    label = {x["path"].rsplit("/", 1)[1]: x["label"]["index"] for x in labelled}
    hits = [x["topk"][0]["index"] == label[x["path"].rsplit("/", 1)[1]] for x in found if "topk" in x]
    assert np.mean(hits) == pytest.approx(validated["two"]["top1"], abs=1e-12)  # the model's weights
    ema_hits = [x["topk"][0]["index"] == x["label"]["index"] for x in labelled]
    assert np.mean(ema_hits) == pytest.approx(validated["state"]["final_ema"]["top1"], abs=1e-12)
    first = labelled[0]["topk"]
    assert len(first) == 3 and first[0]["probability"] >= first[1]["probability"] >= first[2]["probability"]
    assert first[0]["description"].startswith("digit ")
