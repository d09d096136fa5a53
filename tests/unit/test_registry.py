"""The data.toml registry: search order, path resolution, schema errors naming the file."""

from __future__ import annotations

from pathlib import Path

import pytest
from synthetic import make_imagefolder, make_imagenet_loc, write_julia_registry, write_registry

from ddp_cli.data.registry import find_registry, load_registry
from ddp_cli.data.sources.layouts import LAYOUTS, build_index
from ddp_cli.errors import ConfigError, DataError


def entry(name: str, path: str = "data", **extra) -> dict:
    storage = {"driver": "FileSystem", "path": path, **extra.pop("storage", {})}
    return {"name": name, "layout": "imagefolder", **extra, "storage": storage}


@pytest.fixture
def isolated(tmp_path, monkeypatch):
    """A fresh cwd and no $DDP_DATA_TOML."""
    monkeypatch.delenv("DDP_DATA_TOML", raising=False)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    return tmp_path


def three_registries(base: Path) -> tuple[Path, Path, Path]:
    """A registry for each search step, each naming a different data set."""
    out = []
    for where in ("explicit", "env", "cwd"):
        folder = base / where
        folder.mkdir(exist_ok=True)
        out.append(write_registry(folder, [entry(f"from_{where}")]))
    return tuple(out)


def test_explicit_path_beats_env_and_cwd(isolated, monkeypatch):
    explicit, env, _ = three_registries(isolated)
    monkeypatch.setenv("DDP_DATA_TOML", str(env))
    assert find_registry(explicit) == explicit.resolve()
    assert [d.name for d in load_registry(explicit).datasets] == ["from_explicit"]


def test_env_beats_cwd(isolated, monkeypatch):
    _, env, _ = three_registries(isolated)
    monkeypatch.setenv("DDP_DATA_TOML", str(env))
    assert [d.name for d in load_registry().datasets] == ["from_env"]


def test_cwd_data_toml_is_the_fallback(isolated):
    three_registries(isolated)
    registry = load_registry()
    assert registry.path == (isolated / "cwd" / "data.toml").resolve()
    assert [d.name for d in registry.datasets] == ["from_cwd"]


def test_no_registry_anywhere_is_a_config_error(isolated):
    with pytest.raises(ConfigError, match="--registry"):
        load_registry()


def test_missing_explicit_or_env_registry_is_named(isolated, monkeypatch):
    three_registries(isolated)  # ./data.toml exists but must not be used silently
    with pytest.raises(ConfigError, match="missing.toml"):
        load_registry(isolated / "missing.toml")
    monkeypatch.setenv("DDP_DATA_TOML", str(isolated / "env-missing.toml"))
    with pytest.raises(ConfigError, match=r"\$DDP_DATA_TOML.*env-missing.toml"):
        load_registry()


def test_relative_paths_resolve_against_the_registry_folder(isolated):
    folder = isolated / "reg"
    folder.mkdir()
    path = write_registry(folder, [entry("rel", "images/set"), entry("up", "../elsewhere"),
                                   entry("abs", "/srv/data")])
    registry = load_registry(path)  # cwd is isolated/cwd, not the registry's folder
    assert registry.get("rel").storage.path == str(folder / "images" / "set")
    assert registry.get("up").storage.path == str(isolated / "elsewhere")
    assert registry.get("abs").storage.path == "/srv/data"


def test_home_and_env_vars_expand(isolated, monkeypatch):
    home = isolated / "home"
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("DDP_TEST_ROOT", str(isolated / "mnt"))
    path = write_registry(isolated, [entry("home", "~/datasets/x"),
                                     entry("var", "$DDP_TEST_ROOT/imagenet"),
                                     entry("braced", "${DDP_TEST_ROOT}/b")])
    registry = load_registry(path)
    assert registry.get("home").storage.path == str(home / "datasets" / "x")
    assert registry.get("var").storage.path == str(isolated / "mnt" / "imagenet")
    assert registry.get("braced").storage.path == str(isolated / "mnt" / "b")


def test_registry_path_itself_expands_vars(isolated, monkeypatch):
    path = write_registry(isolated, [entry("a")])
    monkeypatch.setenv("DDP_TEST_REG", str(isolated))
    assert find_registry("$DDP_TEST_REG/data.toml") == path.resolve()


def test_s3_entry_keeps_its_url(isolated):
    path = write_registry(isolated, [{"name": "s3", "layout": "imagenet-loc",
                                      "storage": {"driver": "S3", "path": "s3://bucket/imagenet",
                                                  "endpoint_url": "http://127.0.0.1:9000"}}])
    storage = load_registry(path).get("s3").storage
    assert storage.path == "s3://bucket/imagenet"
    assert storage.endpoint_url == "http://127.0.0.1:9000"


def test_s3_path_and_endpoint_expand_vars(isolated, monkeypatch):
    monkeypatch.setenv("DDP_TEST_BUCKET", "team-bucket")
    monkeypatch.setenv("DDP_TEST_PORT", "9000")
    path = write_registry(isolated, [{"name": "s3", "layout": "imagenet-loc",
                                      "storage": {"driver": "S3", "path": "s3://${DDP_TEST_BUCKET}/imagenet",
                                                  "endpoint_url": "http://127.0.0.1:$DDP_TEST_PORT"}}])
    storage = load_registry(path).get("s3").storage
    assert storage.path == "s3://team-bucket/imagenet"
    assert storage.endpoint_url == "http://127.0.0.1:9000"


def write_raw(folder: Path, text: str) -> Path:
    path = folder / "data.toml"
    path.write_text(text)
    return path


BAD_REGISTRIES = {
    "duplicate": (
        [entry("same"), entry("same", "other")],
        r"datasets\[1\] \('same'\): name 'same' appears twice \(also datasets\[0\]\)"),
    "duplicate-uuid": (
        [entry("a", uuid="b498f769-a7f6-4f67-8d74-40b770398f26"),
         entry("b", uuid="B498F769-A7F6-4F67-8D74-40B770398F26")],
        r"datasets\[1\] \('b'\): uuid 'b498f769-a7f6-4f67-8d74-40b770398f26' appears twice "
        r"\(also datasets\[0\]\)"),
    "unset-var": (
        [entry("v", "$DDP_SURELY_UNSET_VAR/imagenet")],
        r"\('v'\): storage\.path: environment variable \$DDP_SURELY_UNSET_VAR is not set"),
    "driver": (
        [entry("d", storage={"driver": "GCS"})],
        r"datasets\[0\] \('d'\): storage\.driver: unknown driver 'GCS'; known: FileSystem, S3$"),
    "layout": (
        [entry("l", layout="coco")],
        r"datasets\[0\] \('l'\): layout: unknown layout 'coco'; known: auto, imagenet-loc, imagefolder, "
        r"shards, csv, parquet$"),
    "uuid": (
        [entry("u", uuid="not-a-uuid")], r"\('u'\): uuid: "),
    "s3-path": (
        [{"name": "s", "layout": "imagefolder", "storage": {"driver": "S3", "path": "/local/dir"}}],
        r"\('s'\): storage\.path must be s3://BUCKET or s3://BUCKET/PREFIX"),
    "s3-no-bucket": (
        [{"name": "s", "layout": "imagefolder", "storage": {"driver": "S3", "path": "s3://"}}],
        r"\('s'\): storage\.path must be s3://BUCKET"),
    "unknown-key": (
        [entry("k", extra_key=1)], r"\('k'\): extra_key: unknown key"),
}


@pytest.mark.parametrize("case", BAD_REGISTRIES)
def test_bad_entries_raise_config_error_naming_the_file(isolated, case):
    entries, pattern = BAD_REGISTRIES[case]
    path = write_registry(isolated, entries)
    with pytest.raises(ConfigError, match=pattern) as info:
        load_registry(path)
    assert str(path.resolve()) in str(info.value)
    assert info.value.exit_code == 2


ONE_ENTRY = ('[[datasets]]\nname = "a"\nlayout = "imagefolder"\n'
             '[datasets.storage]\ndriver = "FileSystem"\npath = "x"\n')


@pytest.mark.parametrize("header", ["data_config_version = 2\n", "", 'data_config_version = "1"\n',
                                    "data_config_version = -1\n", "data_config_version = true\n",
                                    "data_config_version = 1.0\n"])
def test_wrong_data_config_version(isolated, header):
    path = write_raw(isolated, header + ONE_ENTRY)
    with pytest.raises(ConfigError, match="data_config_version must be 0 or 1") as info:
        load_registry(path)
    assert str(path.resolve()) in str(info.value)


@pytest.mark.parametrize("version", [0, 1])
def test_data_config_versions_0_and_1_load(isolated, version):
    path = write_raw(isolated, f"data_config_version = {version}\n" + ONE_ENTRY)
    assert load_registry(path).get("a").layout == "imagefolder"


def test_julia_seed_registry_loads_with_its_type_dropped_and_layout_auto(isolated):
    path = write_julia_registry(isolated, {"imagenet": Path("/home/someone/imagenet")})
    dataset = load_registry(path).get("imagenet")
    assert dataset.layout == "auto"
    assert dataset.storage.model_dump(exclude_none=True) == {
        "driver": "FileSystem", "path": "/home/someone/imagenet", "anon": False}
    assert dataset.uuid is not None and dataset.description.startswith("imagenet")


@pytest.mark.parametrize(("make", "layout"), [(make_imagenet_loc, "imagenet-loc"),
                                              (make_imagefolder, "imagefolder")])
def test_auto_layout_is_settled_when_the_root_is_opened(isolated, make, layout):
    make(isolated / "root")
    dataset = load_registry(write_julia_registry(isolated, {"d": isolated / "root"})).get("d")
    fs, root = dataset.open()
    assert dataset.layout == layout
    assert len(build_index(fs, root, dataset.layout).splits["train"]) > 0


def test_auto_layout_of_an_unrecognised_root_is_a_data_error_naming_it(isolated):
    (isolated / "root" / "images").mkdir(parents=True)
    dataset = load_registry(write_julia_registry(isolated, {"d": isolated / "root"})).get("d")
    with pytest.raises(DataError, match=r"root: cannot tell its layout: neither LOC_synset_mapping\.txt "
                                        r"\(imagenet-loc\), train/ and val/ folders \(imagefolder\), "
                                        r"index\.json \(shards\) nor \*\.parquet files \(parquet") as info:
        dataset.open()
    assert str(isolated / "root") in str(info.value) and info.value.exit_code == 3


def test_registry_layouts_are_the_layouts_mapping(isolated, monkeypatch):
    """One list of layouts: a new mapping entry is a layout the registry accepts."""
    path = write_registry(isolated, [entry(name, layout=name) for name in LAYOUTS])
    assert [d.layout for d in load_registry(path).datasets] == list(LAYOUTS)
    monkeypatch.setitem(LAYOUTS, "shards", lambda fs, root, splits: None)
    path = write_registry(isolated, [entry("s", layout="shards")])
    assert load_registry(path).get("s").layout == "shards"


@pytest.mark.parametrize("body", ["datasets = 3\n", 'datasets = "demo"\n', "datasets = [1]\n"])
def test_datasets_that_is_not_an_array_of_tables_is_a_config_error(isolated, body):
    path = write_raw(isolated, "data_config_version = 1\n" + body)
    with pytest.raises(ConfigError, match="datasets") as info:
        load_registry(path)
    assert str(path.resolve()) in str(info.value)


def test_registry_toml_syntax_error_names_file_and_line(isolated):
    path = write_raw(isolated, "data_config_version = 1\n[[datasets]\n")
    with pytest.raises(ConfigError, match=r"data\.toml: TOML syntax error.*line 2"):
        load_registry(path)


def test_unknown_data_set_suggests_close_name(isolated):
    registry = load_registry(write_registry(isolated, [entry("imagenet_local"), entry("demo")]))
    with pytest.raises(ConfigError, match=r"unknown data set 'imagenet_locl'.*did you mean 'imagenet_local'"):
        registry.get("imagenet_locl")


def test_unknown_data_set_lists_known_names(isolated):
    registry = load_registry(write_registry(isolated, [entry("imagenet_local"), entry("demo")]))
    with pytest.raises(ConfigError) as info:
        registry.get("zzz")
    message = str(info.value)
    assert "known: demo, imagenet_local" in message
    assert str(registry.path) in message


def test_missing_filesystem_root_is_a_data_error_on_open(isolated):
    registry = load_registry(write_registry(isolated, [entry("gone", "not/here")]))
    dataset = registry.get("gone")  # parsing does not touch the disk
    with pytest.raises(DataError, match=r"'gone'.*not/here.*does not exist") as info:
        dataset.open()
    assert info.value.exit_code == 3


def test_existing_filesystem_root_opens(isolated):
    (isolated / "present").mkdir()
    registry = load_registry(write_registry(isolated, [entry("here", "present")]))
    fs, root = registry.get("here").open()
    assert root == str(isolated / "present")
    assert fs.isdir(root)
