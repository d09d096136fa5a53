"""User mistakes: one line on stderr naming the file/key and the fix, the documented exit code."""

from __future__ import annotations

import sys

import pytest
from typer.testing import CliRunner

from ddp_cli.cli import app, main

runner = CliRunner()


def invoke(*args: str):
    return runner.invoke(app, list(args))


def one_error_line(result) -> str:
    stderr = result.err if hasattr(result, "err") else result.stderr  # capsys or CliRunner
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in "".join(lines)
    assert lines[0].startswith("error:")
    return lines[0]


@pytest.fixture()
def config(tmp_path):
    def write(text: str):
        path = tmp_path / "run.toml"
        path.write_text(text)
        return str(path)
    return write


def test_toml_syntax_error_names_file_and_line(config, demo_registry):
    path = config('name = "x"\n[data\nbatch_size = 3\n')
    result = invoke("train", path, "--registry", str(demo_registry), "--dry-run")
    assert result.exit_code == 2
    line = one_error_line(result)
    assert path in line and "line 2" in line


def test_unknown_key_suggests_the_right_one(config, demo_registry):
    result = invoke("train", config("[optim]\nmomentun = 0.9\n"), "--registry", str(demo_registry),
                    "--dry-run")
    assert result.exit_code == 2
    assert "optim.momentun: unknown key (did you mean 'momentum'?)" in one_error_line(result)


def test_bad_value_names_the_key(config, demo_registry):
    result = invoke("train", config("[data]\nbatch_size = -4\n"), "--registry", str(demo_registry),
                    "--dry-run")
    assert result.exit_code == 2
    assert "data.batch_size:" in one_error_line(result)


@pytest.mark.parametrize("dry_run", [["--dry-run"], []], ids=["dry-run", "train"])
def test_a_run_dir_under_a_file_is_exit_2_naming_run_dir_for_train_and_its_dry_run(tmp_path, demo_registry,
                                                                                    dry_run):
    """Preflight's check, met by both: `train` said "internal error (a bug)" and `--dry-run` passed."""
    (tmp_path / "demo.toml").write_text("")
    result = invoke("train", "configs/demo.toml", "--registry", str(demo_registry), "--run-dir",
                    str(tmp_path / "demo.toml" / "sub"), *dry_run)
    assert result.exit_code == 2
    assert one_error_line(result) == (f"error: --run-dir {tmp_path / 'demo.toml' / 'sub'}: "
                                      f"{tmp_path / 'demo.toml'} is a file, not a folder; give a folder for "
                                      "--run-dir (made if missing)")


@pytest.mark.parametrize("setting", ["train.epochs=-1", "train.epochs=0", "train.epochs=1.5",
                                     "schedule.warmup_epochs=-1", "data.min_image_size=64",
                                     "train.max_steps_per_epoch=-1"])
def test_a_bad_set_blames_the_key_the_user_set_not_one_derived_from_it(demo_registry, setting):
    """`train.epochs=-1` once blamed `data.ramp_epochs`, derived from it: the user never set that."""
    result = invoke("train", "configs/demo.toml", "--registry", str(demo_registry), "--set", setting,
                    "--dry-run")
    key = setting.split("=")[0]
    assert result.exit_code == 2
    assert one_error_line(result).startswith(f"error: configs/demo.toml: {key.split('.')[0]}")
    assert key.split(".")[1] in one_error_line(result) and "ramp_epochs" not in result.output


def test_unknown_dataset_lists_known_names(config, demo_registry):
    result = invoke("train", config('[data]\ndataset = "dmeo"\n'), "--registry", str(demo_registry),
                    "--dry-run")
    assert result.exit_code == 2
    assert "did you mean 'demo'" in one_error_line(result)


def test_unknown_model_suggests_close_names(config, demo_registry):
    result = invoke("train", config('[model]\nname = "resnet35"\n'), "--registry",
                    str(demo_registry), "--dry-run")
    assert result.exit_code == 2
    assert "resnet34" in one_error_line(result)


def test_missing_config_file(demo_registry, tmp_path):
    result = invoke("train", str(tmp_path / "nope.toml"), "--registry", str(demo_registry))
    assert result.exit_code == 2
    assert "nope.toml" in one_error_line(result)


def test_malformed_set_override(config, demo_registry):
    result = invoke("train", config(""), "--registry", str(demo_registry), "--set", "optim.lr",
                    "--dry-run")
    assert result.exit_code == 2
    assert "KEY=VALUE" in one_error_line(result)


def test_missing_data_root_is_a_data_error(config, tmp_path):
    registry = tmp_path / "data.toml"
    registry.write_text('data_config_version = 1\n[[datasets]]\nname = "gone"\nlayout = "imagefolder"\n'
                        '[datasets.storage]\ndriver = "FileSystem"\npath = "nowhere"\n')
    result = invoke("train", config('[data]\ndataset = "gone"\n'), "--registry", str(registry),
                    "--dry-run")
    assert result.exit_code == 3
    assert "nowhere" in one_error_line(result)


def test_validate_missing_and_garbage_checkpoints(tmp_path):
    result = invoke("validate", "--checkpoint", str(tmp_path / "none.pt"))
    assert result.exit_code == 2 and "none.pt" in one_error_line(result)
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a checkpoint at all")
    result = invoke("validate", "--checkpoint", str(garbage))
    assert result.exit_code == 3 and f"{garbage}: not a checkpoint (" in one_error_line(result)
    assert "weights_only" not in result.output  # torch's advice to load it unsafely is not repeated


REGISTRY_HEAD = 'data_config_version = 1\n'
ENTRY = ('[[datasets]]\nname = "{name}"\nlayout = "{layout}"\nuuid = "{uuid}"\n'
         '[datasets.storage]\ndriver = "{driver}"\npath = "{path}"\n')


def entry(name="demo", layout="imagenet-loc", uuid="6f1d3c0e-8a52-4c1b-9d0e-2a7b5e4c9f10",
          driver="FileSystem", path="DEMO"):
    return ENTRY.format(name=name, layout=layout, uuid=uuid, driver=driver, path=path)


# (registry text or None for the good one, config text, extra args, exit code, text in the message)
BAD_INPUTS = {
    "registry duplicate name": (REGISTRY_HEAD + entry() + entry(), "", [], 2, "appears twice"),
    "registry unknown driver": (REGISTRY_HEAD + entry(driver="Ftp"), "", [], 2, "storage.driver"),
    "registry unknown layout": (REGISTRY_HEAD + entry(layout="coco"), "", [], 2, "layout"),
    "registry bad uuid": (REGISTRY_HEAD + entry(uuid="not-a-uuid"), "", [], 2, "uuid"),
    "registry wrong version": ("data_config_version = 7\n" + entry(), "", [], 2, "data_config_version"),
    "registry s3 path without scheme": (REGISTRY_HEAD + entry(driver="S3", path="bucket/x"), "", [], 2,
                                        "s3://"),
    "registry toml syntax": (REGISTRY_HEAD + "[[datasets]\n", "", [], 2, "line"),
    "unknown class": (None, '[data]\nclasses = ["n0999"]\n', [], 2, "data.classes"),
    "class count out of range": (None, "[data]\nclasses = 11\n", [], 2, "out of range"),
    "empty class list": (None, "[data]\nclasses = []\n", [], 2, "data.classes"),
    "bad enum value": (None, '[data]\non_bad_image = "ignore"\n', [], 2, "data.on_bad_image"),
    "unknown section": (None, "[optimiser]\nlr = 1\n", [], 2, "did you mean 'optim'"),
    "wrong type": (None, '[train]\nepochs = "ten"\n', [], 2, "train.epochs"),
    "bad nproc in config": (None, '[distributed]\nnproc_per_node = "many"\n', [], 2,
                            "distributed.nproc_per_node"),
    "set into a value": (None, "", ["--set", "seed.x=1"], 2, "seed"),
    "bad flag value": (None, "", ["--nproc-per-node", "0"], 2, "--nproc-per-node"),
    "unknown flag": (None, "", ["--nprocs", "2"], 2, "--nprocs"),
    "multi-node without endpoint": (None, "", ["--nnodes", "2"], 2, "--rdzv-endpoint"),
    "missing registry flag path": (None, "", ["--registry", "/nope/data.toml"], 2, "/nope/data.toml"),
    "resume from a missing file": (None, "", ["--resume", "/nope/last.pt"], 2, "--resume"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS), ids=list(BAD_INPUTS))
def test_bad_input_is_one_line_with_its_exit_code(case, demo_root, demo_registry, tmp_path, capsys,
                                                   monkeypatch):
    """Through the real entry point (`ddp_cli.cli:main`), as the installed `ddp` runs it."""
    registry_text, config_text, extra, code, needle = BAD_INPUTS[case]
    registry = demo_registry
    if registry_text is not None:
        registry = tmp_path / "data.toml"
        registry.write_text(registry_text.replace("DEMO", str(demo_root)))
    config = tmp_path / "run.toml"
    config.write_text('name = "bad"\n' + config_text)
    dry = [] if "--resume" in extra or "--nnodes" in extra else ["--dry-run"]
    monkeypatch.setattr(sys, "argv", ["ddp", "train", str(config), "--registry", str(registry),
                                      *dry, *extra])
    with pytest.raises(SystemExit) as exited:
        main()
    captured = capsys.readouterr()
    assert exited.value.code == code, captured.err
    assert needle in one_error_line(captured)


@pytest.mark.parametrize(("url", "needle"), [("gs://b/r", "a folder or to s3://BUCKET/PREFIX/NAME"),
                                             ("s3://bucket", "give s3://BUCKET/PREFIX/NAME")])
def test_a_run_dir_url_ddp_cannot_write_is_refused_before_anything_is_written(url, needle, tmp_path,
                                                                              monkeypatch):
    """A Path would keep `gs://b/r` as the local folder `gs:/b/r`: the run would land on the pod's disk
    while its user believes it is in the bucket (s3:// run dirs are written to the bucket: run.bucket)."""
    monkeypatch.chdir(tmp_path)
    result = invoke("train", "configs/demo.toml", "--run-dir", url)
    assert result.exit_code == 2
    line = one_error_line(result)
    assert url in line and needle in line
    assert list(tmp_path.iterdir()) == []
