"""Real OS errors and hostile directories under the L3 file store.

No input from the disk may stop a node: every OS error of `exists`, `get` or `put` is a miss or a
page reported not written, logged once per kind; nothing is read or written outside the root;
start-up clean-up removes only temporaries of writers that are gone; and a page nobody with the
cluster secret wrote reads as a miss. Full and read-only file systems are real: a small tmpfs
(mounting needs root, as in CI; the tests skip otherwise), since `chmod` does not stop root.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import struct
import subprocess
import threading
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import trio
from node_pair import assert_nothing_held, node_pair, prompt, turn
from test_runtime_storage import LAYOUT, filled_pool, rows

from hicache.runtime.kv.kv_pool import KVPool
from hicache.runtime.storage import FileStore
from hicache.runtime.storage import file_store as fs
from hicache.runtime.storage.file_recovery import host_tag, temp_name

LOGGER = "hicache.runtime.storage"


@pytest.fixture(autouse=True)
def _no_cluster_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    """The key comes from each test's own choice, never from the environment of the run."""
    monkeypatch.delenv("HICACHE_CLUSTER_SECRET", raising=False)


def warnings_about(caplog: pytest.LogCaptureFixture, word: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and word in r.getMessage()]


def files_under(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*")}


# ------------------------------------------------------------------------------- real mounts


def _mount(*args: str) -> None:
    done = subprocess.run(["mount", *args], capture_output=True, text=True, check=False)
    if done.returncode:
        raise OSError(f"mount {' '.join(args)}: {done.stderr.strip()}")


@contextmanager
def tmpfs(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` mounted at `path` for the duration (root only; skips otherwise)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (CI runs these as root); chmod does not stop root")
    path.mkdir(parents=True, exist_ok=True)
    try:
        _mount("-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path))
    except OSError as exc:
        pytest.skip(f"cannot mount a tmpfs here (no CAP_SYS_ADMIN?): {exc}")
    try:
        yield path
    finally:
        if subprocess.run(["umount", str(path)], capture_output=True, check=False).returncode:
            subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False)


def remount_read_only(path: Path) -> None:
    _mount("-o", "remount,ro", str(path))


def fill_up(folder: Path) -> None:
    """Write a file under `folder` until the file system is full."""
    fd = os.open(folder / "filler", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        while True:
            os.write(fd, b"\xff" * 4096)
    except OSError as exc:
        assert exc.errno == errno.ENOSPC, exc
    finally:
        os.close(fd)


# ========================================================================== full and read-only


async def test_a_full_file_system_reports_the_pages_not_written(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    n = 96  # files of one 4 KiB block each: more than 256 KiB holds
    pool = filled_pool(n, seed=1)
    keys = list(range(1000, 1000 + n))
    with tmpfs(tmp_path / "l3", "256k") as root:
        store = FileStore(root, LAYOUT)
        missed = await store.put(keys, pool, range(n))
        assert 0 < len(missed) < n, missed
        held = [i for i in range(n) if i not in missed]
        dst = KVPool(LAYOUT, n)
        for i in held:  # every page reported written reads back exactly
            assert await store.get([keys[i]], dst, [i]) == 1
            assert np.array_equal(rows(dst)[i], rows(pool)[i])
        for i in missed:  # and every page reported missing is a miss
            assert await store.exists([keys[i]]) == 0
        assert await store.put([keys[i] for i in missed], pool, missed) == list(range(len(missed)))
        assert not [p for p in root.rglob("*.tmp")]
        assert store.stats.errors >= len(missed)
        assert len(warnings_about(caplog, "ENOSPC")) == 1  # once per kind, not per page
        await store.aclose()


async def test_a_read_only_file_system_serves_what_it_holds_and_writes_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    pool = filled_pool(8, seed=2)
    with tmpfs(tmp_path / "l3", "1m") as root:
        first = FileStore(root, LAYOUT)
        assert await first.put(list(range(4)), pool, range(4)) == []
        remount_read_only(root)
        before = files_under(root)
        for store in (first, FileStore(root, LAYOUT)):  # a running store, and one opened now
            assert await store.put(list(range(2, 8)), pool, range(2, 8)) == [2, 3, 4, 5]
            dst = KVPool(LAYOUT, 8)
            assert await store.get(list(range(8)), dst, range(8)) == 4
            assert np.array_equal(rows(dst)[:4], rows(pool)[:4])
            assert await store.exists(list(range(8))) == 4
        assert files_under(root) == before
        assert len(warnings_about(caplog, "EROFS")) == 2  # once per store


async def test_a_store_opened_on_a_read_only_file_system_without_a_key_still_runs(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    with tmpfs(tmp_path / "l3", "1m") as root:
        (root / "empty").mkdir()
        remount_read_only(root)
        for where in (root, root / "empty", root / "absent" / "l3"):
            store = FileStore(where, LAYOUT)  # no key file, none can be written, no folder: no raise
            assert await store.put([1, 2], filled_pool(), [0, 1]) == [0, 1]
            assert await store.get([1], KVPool(LAYOUT, 1), [0]) == 0
            assert await store.exists([1]) == 0
        assert warnings_about(caplog, "EROFS")


# ======================================================================== hostile directories


async def test_a_symlink_loop_as_a_page_file_is_a_miss_and_a_put_replaces_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    store = FileStore(tmp_path, LAYOUT)
    pool = filled_pool(seed=3)
    await store.put([1], pool, [0])
    loop = store.path(2)
    loop.parent.mkdir(exist_ok=True)
    loop.symlink_to(loop.name)  # points at itself
    dst = KVPool(LAYOUT, 2)
    assert await store.exists([1, 2]) == 1
    assert await store.get([1, 2], dst, [0, 1]) == 1
    assert warnings_about(caplog, "ELOOP")
    assert await store.put([2], pool, [1]) == []  # the link itself is replaced, not followed
    assert not loop.is_symlink()
    assert await store.get([1, 2], dst, [0, 1]) == 2
    assert np.array_equal(rows(dst), rows(pool)[:2])


async def test_a_page_path_through_a_regular_file_is_a_miss_and_not_written(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    store = FileStore(tmp_path, LAYOUT)
    key = 0x0123456789ABCDEF
    (tmp_path / "01").write_bytes(b"not a folder")
    pool = filled_pool()
    assert await store.put([7, key, 9], pool, [0, 1, 2]) == [1]
    assert await store.exists([7, key]) == 1
    assert await store.get([7, key], KVPool(LAYOUT, 2), [0, 1]) == 1
    assert (tmp_path / "01").read_bytes() == b"not a folder"
    assert len(warnings_about(caplog, "ENOTDIR")) == 2  # once for reads, once for writes


async def test_a_directory_where_a_page_file_belongs_is_a_miss_and_not_written(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    store = FileStore(tmp_path, LAYOUT)
    store.path(5).mkdir(parents=True)
    assert await store.put([5], filled_pool(), [0]) == [0]
    assert await store.exists([5]) == 0
    assert await store.get([5], KVPool(LAYOUT, 1), [0]) == 0
    assert store.path(5).is_dir()
    assert warnings_about(caplog, "EISDIR")


@pytest.mark.parametrize("code", [errno.EIO, errno.EACCES, errno.ENAMETOOLONG])
async def test_any_os_error_is_a_miss_or_a_page_not_written(
    code: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Errors a test cannot cause for real (a failing disk; EACCES, which root ignores)."""
    caplog.set_level(logging.WARNING, logger=LOGGER)
    store = FileStore(tmp_path, LAYOUT)
    pool = filled_pool(seed=4)
    await store.put([1, 2], pool, [0, 1])
    real_open = os.open

    def failing_open(path: object, flags: int, *args: object, **kwargs: object) -> int:
        if str(path).endswith((fs.SUFFIX, ".tmp")):
            raise OSError(code, os.strerror(code), str(path))
        return real_open(path, flags, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "open", failing_open)
    assert await store.get([1, 2], KVPool(LAYOUT, 2), [0, 1]) == 0
    assert await store.put([3, 4], pool, [2, 3]) == [0, 1]
    monkeypatch.undo()
    assert await store.get([1, 2], KVPool(LAYOUT, 2), [0, 1]) == 2
    assert len(warnings_about(caplog, errno.errorcode[code])) == 2  # one for reads, one for writes


async def test_a_symlinked_sub_folder_is_never_followed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    monkeypatch.setenv("HICACHE_CLUSTER_SECRET", "cluster-secret-of-tests")  # every store here shares it
    root, outside = tmp_path / "l3", tmp_path / "outside"
    outside.mkdir()
    key = 0x0123456789ABCDEF
    # What a writer with the secret would have put there: a valid page.
    decoy = FileStore(tmp_path / "decoy", LAYOUT)
    pool = filled_pool(seed=5)
    await decoy.put([key], pool, [0])
    (outside / decoy.path(key).name).write_bytes(decoy.path(key).read_bytes())
    before = {p.name: p.read_bytes() for p in outside.iterdir()}
    root.mkdir()
    (root / "01").symlink_to(outside, target_is_directory=True)

    store = FileStore(root, LAYOUT)
    assert await store.exists([key]) == 0
    assert await store.get([key], KVPool(LAYOUT, 1), [0]) == 0  # the valid page there is not served
    assert await store.put([key, 7], pool, [1, 2]) == [0]
    assert {p.name: p.read_bytes() for p in outside.iterdir()} == before  # nothing written outside
    assert (root / "01").is_symlink()
    assert warnings_about(caplog, "ELOOP")


async def test_start_up_clean_up_does_not_follow_a_symlinked_sub_folder(tmp_path: Path) -> None:
    root, outside = tmp_path / "l3", tmp_path / "outside"
    outside.mkdir()
    root.mkdir()
    (root / "01").symlink_to(outside, target_is_directory=True)
    (outside / ".0123456789abcdef.a1b2c3.tmp").write_bytes(b"someone else's")  # version 1's naming
    FileStore(root, LAYOUT)
    assert (outside / ".0123456789abcdef.a1b2c3.tmp").exists()
    stale = outside / temp_name(0x0123456789ABCDEF, pid=_reaped_pid())  # one it would remove
    stale.write_bytes(b"partial")
    assert FileStore(root, LAYOUT).leftovers_removed == 0
    assert stale.exists() and (root / "01").is_symlink()


# ============================================================================= temporary files


def _reaped_pid() -> int:
    """The pid of a child that has exited and been reaped (so no process has it, for now)."""
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


async def test_a_live_neighbours_temporary_file_survives_another_store_opening(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store whose write is caught between its temporary file and the rename, while another
    store opens the same directory: the write completes and the page reads back."""
    writer = FileStore(tmp_path, LAYOUT)
    pool = filled_pool(seed=6)
    in_write, go_on = threading.Event(), threading.Event()
    real_replace = os.replace

    def paused_replace(*args: object, **kwargs: object) -> None:
        in_write.set()
        assert go_on.wait(60)
        real_replace(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "replace", paused_replace)
    async with trio.open_nursery() as nursery:
        result: list[list[int]] = []

        async def write() -> None:
            result.append(await writer.put([1], pool, [0]))

        nursery.start_soon(write)
        try:
            await trio.to_thread.run_sync(in_write.wait, 60)
            assert [p for p in tmp_path.rglob("*.tmp")]  # the neighbour's write is in flight
            opened = FileStore(tmp_path, LAYOUT)
        finally:
            go_on.set()
    monkeypatch.undo()
    assert result == [[]] and opened.leftovers_removed == 0
    dst = KVPool(LAYOUT, 1)
    assert await opened.get([1], dst, [0]) == 1
    assert np.array_equal(rows(dst)[0], rows(pool)[0])


async def test_start_up_removes_only_temporaries_of_writers_that_are_gone(tmp_path: Path) -> None:
    store = FileStore(tmp_path, LAYOUT)
    await store.put([0x0123456789ABCDEF], filled_pool(), [0])
    sub = tmp_path / "01"
    with subprocess.Popen(["sleep", "60"]) as alive:
        try:
            live = [sub / temp_name(0x0123456789ABCDEF, pid=alive.pid), sub / temp_name(1)]
            gone = [sub / temp_name(0x0123456789ABCDEF, pid=_reaped_pid())]
            other_host = [sub / temp_name(2, pid=_reaped_pid()).replace(host_tag(), "0badc0de")]
            for p in live + gone + other_host:
                p.write_bytes(b"partial")
            assert FileStore(tmp_path, LAYOUT).leftovers_removed == 1
            assert not any(p.exists() for p in gone)
            assert all(p.exists() for p in live + other_host)
        finally:
            alive.kill()


# ===================================================================================== forgery


def old_format_page(key: int, payload: bytes) -> bytes:
    """A page file as version 1 wrote it: a CRC-32 anyone can compute, no key."""
    header = struct.Struct("<8sHHIQ5I16sQI8x").pack(
        b"HICKVPG\0", 1, 80, 0, key, *LAYOUT.page_shape, b"bfloat16", LAYOUT.page_bytes, zlib.crc32(payload)
    )
    return header + payload


async def test_a_page_in_the_old_unkeyed_format_is_a_miss(tmp_path: Path) -> None:
    store = FileStore(tmp_path, LAYOUT)
    path = store.path(3)
    path.parent.mkdir()
    path.write_bytes(old_format_page(3, b"\x11" * LAYOUT.page_bytes))
    dst = KVPool(LAYOUT, 1)
    assert await store.get([3], dst, [0]) == 0
    assert store.stats.corrupt == 1 and store.stats.hits == 0


async def test_a_page_forged_with_another_key_is_a_miss(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A forger who can write the directory but does not know the secret: whatever it writes,
    header and MAC included, reads as a miss; the same page under the right secret reads."""
    pool = filled_pool(seed=7)
    monkeypatch.setenv("HICACHE_CLUSTER_SECRET", "a forger's guess, 16+")
    await FileStore(tmp_path / "forged", LAYOUT).put([4], pool, [0])
    monkeypatch.setenv("HICACHE_CLUSTER_SECRET", "cluster-secret-of-tests")
    store = FileStore(tmp_path / "l3", LAYOUT)
    target = store.path(4)
    target.parent.mkdir()
    target.write_bytes((tmp_path / "forged" / target.relative_to(tmp_path / "l3")).read_bytes())
    dst = KVPool(LAYOUT, 1)
    assert await store.exists([4]) == 1  # a hint: right size
    assert await store.get([4], dst, [0]) == 0
    assert store.stats.corrupt == 1
    target.unlink()
    assert await store.put([4], pool, [0]) == []
    assert await store.get([4], dst, [0]) == 1


async def test_the_secret_comes_from_the_argument_the_environment_or_the_key_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pool = filled_pool(seed=8)
    dst = KVPool(LAYOUT, 1)
    # no argument, no environment: a random key in the root, 0600, shared by every store there
    await FileStore(tmp_path, LAYOUT).put([5], pool, [0])
    key_file = tmp_path / fs.KEY_FILE
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert await FileStore(tmp_path, LAYOUT).get([5], dst, [0]) == 1
    # the key file's contents, given to a store elsewhere, is the same secret
    secret = key_file.read_text().strip()
    assert await FileStore(tmp_path, LAYOUT, secret=secret).get([5], dst, [0]) == 1
    monkeypatch.setenv(fs.SECRET_ENV, secret)
    assert await FileStore(tmp_path, LAYOUT).get([5], dst, [0]) == 1
    monkeypatch.setenv(fs.SECRET_ENV, "another cluster secret")
    assert await FileStore(tmp_path, LAYOUT).get([5], dst, [0]) == 0
    assert await FileStore(tmp_path, LAYOUT, secret=secret).get([5], dst, [0]) == 1  # argument wins
    with pytest.raises(ValueError, match="secret"):
        FileStore(tmp_path, LAYOUT, secret=b"")


@pytest.mark.parametrize("how", ["group_readable", "symlink", "not_a_file"])
async def test_an_untrustworthy_key_file_is_not_used(
    how: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Someone who can write the directory could plant a key file of their own: one that others
    can read, a link, or something else is refused, the store runs on a key of its own for this
    process, and says so."""
    caplog.set_level(logging.WARNING, logger=LOGGER)
    root = tmp_path / "l3"
    root.mkdir()
    key_file = root / fs.KEY_FILE
    if how == "group_readable":
        key_file.write_text("planted")
        key_file.chmod(0o640)
    elif how == "symlink":
        (tmp_path / "planted").write_text("planted")
        (tmp_path / "planted").chmod(0o600)
        key_file.symlink_to(tmp_path / "planted")
    else:
        key_file.mkdir()
    forger = FileStore(tmp_path / "forger", LAYOUT, secret=b"planted")
    pool = filled_pool(seed=9)
    await forger.put([6], pool, [0])
    store = FileStore(root, LAYOUT)
    store.path(6).parent.mkdir()
    store.path(6).write_bytes(forger.path(6).read_bytes())
    assert await store.get([6], KVPool(LAYOUT, 1), [0]) == 0
    assert warnings_about(caplog, fs.KEY_FILE)
    assert await store.put([7], pool, [1]) == []  # it still works, with a key of its own
    assert await store.get([7], KVPool(LAYOUT, 1), [0]) == 1


# ============================================================================ a live decode node


@pytest.mark.slow
async def test_a_decode_node_whose_l3_fills_up_then_turns_read_only_serves_every_request(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Conversations go on while L3 is healthy, full, then read-only: every request finishes
    with bit-exact KV (`turn` checks it), pages already in L3 keep being restored from it, and
    the node is at rest with nothing held at the end."""
    caplog.set_level(logging.WARNING, logger=LOGGER)
    with tmpfs(tmp_path / "l3", "4m") as root:
        async with node_pair(tmp_path) as pair:
            client, ledger = pair.client, pair.ledger
            convs = {i: prompt(10 + i) for i in range(3)}
            from_l3 = {}

            async def round_(phase: str) -> None:
                for i, conv in convs.items():
                    reply = await turn(client, ledger, f"{phase}{i}", conv)
                    assert reply["outcome"] == "finished", reply
                    convs[i] = conv + reply["tokens"] + prompt(100 + i + len(conv), 20)
                # only L3 keeps the conversations now: the next round restores from it
                await client.evict(l1=1 << 30, l2=1 << 30)
                await client.idle()

            async def restored(phase: str) -> int:
                total = 0
                for i, conv in convs.items():
                    reply = await turn(client, ledger, f"{phase}-again{i}", conv)
                    assert reply["outcome"] == "finished", reply
                    total += reply["account"]["l3"]
                await client.evict(l1=1 << 30, l2=1 << 30)
                await client.idle()
                return total

            await round_("healthy")
            from_l3["healthy"] = await restored("healthy")
            await trio.to_thread.run_sync(fill_up, root)
            await round_("full")
            from_l3["full"] = await restored("full")
            await trio.to_thread.run_sync(remount_read_only, root)
            await round_("ro")
            from_l3["ro"] = await restored("ro")
            await assert_nothing_held(pair.service, client)
            assert all(n > 0 for n in from_l3.values()), from_l3
    assert warnings_about(caplog, "ENOSPC") and warnings_about(caplog, "EROFS")


async def test_a_decode_node_whose_page_files_turn_into_symlink_loops_serves_every_request(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Every page file of a conversation replaced by a symlink to itself: the next turn's
    query and read meet ELOOP, which is a miss; the turn is served from prefill instead."""
    caplog.set_level(logging.WARNING, logger=LOGGER)
    async with node_pair(tmp_path) as pair:
        client, ledger = pair.client, pair.ledger
        first = prompt(1)
        reply = await turn(client, ledger, "a", first)
        await client.evict(l1=1 << 30, l2=1 << 30)  # only the L3 files keep the conversation
        await client.idle()
        pages = sorted((tmp_path / "l3").rglob(f"*{fs.SUFFIX}"))
        assert pages
        for page in pages:
            page.unlink()
            page.symlink_to(page.name)
        reply = await turn(client, ledger, "b", first + reply["tokens"] + prompt(2, 20))
        assert reply["outcome"] == "finished", reply
        assert reply["account"]["l3"] == 0
        await assert_nothing_held(pair.service, client)
    assert warnings_about(caplog, "ELOOP")
