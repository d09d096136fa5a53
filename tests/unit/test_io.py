"""Atomic writes and safe loads (ddp_cli/io.py): a file is replaced whole or not at all; a load takes
plain data only, and names the file it refuses."""

from __future__ import annotations

import hashlib
import os
import stat

import pytest
import torch

from ddp_cli import io
from ddp_cli.errors import DataError


def test_atomic_write_creates_folders_and_returns_the_sha256_and_size(tmp_path):
    path = tmp_path / "a" / "b" / "f.bin"
    data = os.urandom(3000)
    digest, size = io.atomic_write(path, lambda f: (f.write(data[:1000]), f.write(data[1000:])))
    assert path.read_bytes() == data
    assert (digest, size) == (hashlib.sha256(data).hexdigest(), 3000)
    assert os.listdir(path.parent) == ["f.bin"]


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temp_file(tmp_path):
    path = tmp_path / "f.txt"
    io.write_text(path, "old")

    def half(f):
        f.write(b"new, half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        io.atomic_write(path, half)
    assert path.read_text() == "old"
    assert os.listdir(tmp_path) == ["f.txt"]


def test_write_text_replaces_the_file(tmp_path):
    path = tmp_path / "f.txt"
    io.write_text(path, "one")
    io.write_text(path, "twö")
    assert path.read_text(encoding="utf-8") == "twö"


def test_sha256_of_reads_a_file_larger_than_a_block(tmp_path):
    data = os.urandom((1 << 20) + 5)
    (tmp_path / "f").write_bytes(data)
    assert io.sha256_of(tmp_path / "f") == hashlib.sha256(data).hexdigest()


def test_load_plain_loads_tensors_and_containers(tmp_path):
    torch.save({"format": io.CHECKPOINT_FORMAT, "w": torch.arange(3)}, tmp_path / "c.pt")
    state = io.load_plain(tmp_path / "c.pt")
    assert torch.equal(state["w"], torch.arange(3)) and io.is_checkpoint(state)


class Executes:  # any class: weights_only refuses to build it
    pass


def test_load_plain_refuses_objects_and_names_the_file_without_torchs_unsafe_advice(tmp_path):
    """torch's message says a retry with weights_only=False "will likely succeed": that runs the file's
    code. The error says what was refused and nothing more."""
    torch.save({"x": Executes()}, tmp_path / "evil.pt")
    refused = (r"evil\.pt: refused, it holds more than plain data \(weights_only load\): "
               r"Unsupported global: GLOBAL .*Executes was not an allowed global by default\.$")
    with pytest.raises(DataError, match=refused) as error:
        io.load_plain(tmp_path / "evil.pt")
    assert "weights_only` set to `False" not in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("content", [b"[data]\nname = 'demo'\n", b"\xff\xd8\xff\xe0 a JPEG"],
                         ids=["toml", "jpeg"])
def test_a_file_that_is_no_torch_file_is_named_not_a_checkpoint(tmp_path, content):
    """`ddp validate --checkpoint demo.toml`: torch reads it as a pickle with objects and advises
    weights_only=False; it is not a checkpoint at all."""
    (tmp_path / "demo.toml").write_bytes(content)
    with pytest.raises(DataError, match=r"^\S+demo\.toml: not a checkpoint \(a torch\.save file begins "
                                        r"with a zip or pickle header, this one with b'.{1,16}'\); give"):
        io.load_plain(tmp_path / "demo.toml")


@pytest.mark.parametrize(("content", "reason"),
                         [(b"", r"\(EOFError\)"), (b"PK\x03\x04 not a zip", r"\(.+\)")],
                         ids=["empty", "broken"])
def test_a_truncated_or_broken_file_is_a_data_error_naming_it(tmp_path, content, reason):
    """An empty file's error has no message: its class stands in (an IndexError before)."""
    (tmp_path / "bad.pt").write_bytes(content)
    with pytest.raises(DataError, match=r"bad\.pt: unreadable or truncated checkpoint " + reason + "$"):
        io.load_plain(tmp_path / "bad.pt")


def test_a_truncated_checkpoint_is_a_data_error(tmp_path):
    torch.save({"w": torch.zeros(1000)}, tmp_path / "c.pt")
    data = (tmp_path / "c.pt").read_bytes()
    (tmp_path / "c.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(DataError, match="unreadable or truncated"):
        io.load_plain(tmp_path / "c.pt")


@pytest.mark.parametrize(("state", "expected"), [({"format": io.CHECKPOINT_FORMAT}, True),
                                                 ({"format": io.CHECKPOINT_FORMAT + 1}, False),
                                                 ({}, False), ([("format", 1)], False)])
def test_is_checkpoint_needs_a_dict_with_the_format_marker(state, expected):
    assert io.is_checkpoint(state) is expected


@pytest.fixture(params=[0o022, 0o027, 0o077], ids=["umask022", "umask027", "umask077"])
def umask(request):
    """The process umask set for one test and restored after it."""
    old = os.umask(request.param)
    yield request.param
    os.umask(old)


@pytest.mark.parametrize("writer", [
    lambda path: io.atomic_write(path, lambda f: f.write(b"x")),
    lambda path: io.write_text(path, "x"),
    lambda path: io.atomic_write(path, lambda f: torch.save({"w": torch.ones(2)}, f)),
], ids=["atomic_write", "write_text", "torch.save"])
def test_a_written_file_has_the_mode_the_umask_gives_new_files(tmp_path, umask, writer):
    """0644 under 0022, 0640 under 0027: a teammate or a serving process can read what a run wrote
    (mkstemp's 0600 shut them out); a replaced file gets it too, and 0077 still keeps a file private."""
    for _ in range(2):  # created, then replaced
        writer(tmp_path / "f")
        assert stat.S_IMODE((tmp_path / "f").stat().st_mode) == 0o666 & ~umask
    assert os.listdir(tmp_path) == ["f"]


def test_the_temp_file_is_hidden_beside_the_target(tmp_path):
    """Beside it: on the same file system, so the rename is atomic; hidden and marked .tmp, so a listing
    of checkpoints never takes it for one."""
    path = tmp_path / "f.bin"
    seen = []
    io.atomic_write(path, lambda f: seen.extend(os.listdir(tmp_path)))
    assert len(seen) == 1 and seen[0].startswith(".f.bin.") and seen[0].endswith(".tmp")


def test_a_checkpoint_of_another_pickle_protocol_is_refused_in_one_line_without_torchs_warning(tmp_path):
    """torch warns about an unusual pickle protocol above the error: the error alone says it."""
    import warnings

    path = tmp_path / "p4.pt"
    torch.save({"w": torch.ones(2)}, path, pickle_protocol=4)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with pytest.raises(DataError, match=f"^{path}: refused, it holds more than plain data"):
            io.load_plain(path)
    assert [str(w.message) for w in seen] == []


@pytest.mark.parametrize(("size", "words"), [
    (0, "0 B"), (999, "999 B"), (1000, "1.0 kB"), (12_345, "12.3 kB"), (3_100_000, "3.1 MB"),
    (10**9 - 1, "1000.0 MB"), (10**9, "1.0 GB"), (2_500_000_000, "2.5 GB"), (10**12, "1.0 TB"),
    (4_200_000_000_000, "4.2 TB"),
])
def test_sizes_read_as_a_person_reads_them(size, words):
    assert io.size_words(size) == words


def test_a_full_disk_names_the_folder_of_the_file_the_error_names_and_the_room(tmp_path):
    """The folder whose disk is full is the written file's (the OSError's own file name first), its
    parent where the file exists, with the bytes needed and free."""
    import errno

    target = tmp_path / "ckpt" / "step.pt"
    target.parent.mkdir()
    target.write_bytes(b"x")
    error = OSError(errno.ENOSPC, "No space left on device", str(target))
    words = io.cause(errno.ENOSPC, "", error, 2_500_000)
    assert words.startswith(f"no space left on the device holding {target.parent}: 2.5 MB needed, ")
    assert words.endswith(" free")


def test_a_uid_without_a_name_is_shown_as_its_number():
    assert io.owner(2**31 - 7) == str(2**31 - 7)


def test_a_permission_error_keeps_its_own_errno_and_one_without_counts_as_eacces():
    import errno

    assert io.refusal(PermissionError(errno.EPERM, "Operation not permitted"), frozenset(io.REFUSALS))[0] == \
        errno.EPERM
    assert io.refusal(PermissionError("Access Denied"), frozenset(io.REFUSALS))[0] == errno.EACCES
