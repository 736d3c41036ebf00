"""The lock per GPU against real processes and a hostile lock directory."""

import errno
import fcntl
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from cpupin import claim_gpus
from cpupin.registry.lock import lock_path

GPU = "0000:3b:00.0"
OTHER = "0000:5d:00.0"
NOBODY = 65534


def claim_in_child(lock_dir, *gpus, uid=None):
    """(held, reason) of a claim made by a fresh process, as ``uid`` if given
    (it drops to it after importing: the interpreter may be root's alone)."""
    drop = f"import os; os.setgid({uid}); os.setuid({uid})" if uid is not None else ""
    code = textwrap.dedent(f"""
        from cpupin import claim_gpus
        {drop}
        c = claim_gpus({list(gpus)!r}, {str(lock_dir)!r})
        print(int(bool(c)), c.reason)
    """)
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0, out.stderr
    held, reason = out.stdout.strip().split(" ", 1)
    return held == "1", reason


class Holder:
    """A process that claims GPUs and holds them until stopped."""

    def __init__(self, lock_dir, *gpus):
        code = textwrap.dedent(f"""
            import sys
            from cpupin import claim_gpus
            c = claim_gpus({list(gpus)!r}, {str(lock_dir)!r})
            print(int(bool(c)), flush=True)
            sys.stdin.read()
        """)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert self.proc.stdout.readline().strip() == "1"

    def stop(self, kill=False):
        if kill:
            self.proc.send_signal(signal.SIGKILL)
        else:
            self.proc.stdin.close()
        self.proc.wait(timeout=60)


def test_a_second_process_is_refused_until_the_first_exits(tmp_path):
    holder = Holder(tmp_path, GPU)
    try:
        held, reason = claim_in_child(tmp_path, GPU)
        assert not held
        assert GPU in reason and lock_path(GPU, tmp_path) in reason
    finally:
        holder.stop()
    assert claim_in_child(tmp_path, GPU)[0]


def test_a_killed_holder_frees_the_lock(tmp_path):
    holder = Holder(tmp_path, GPU)
    assert not claim_in_child(tmp_path, GPU)[0]
    holder.stop(kill=True)
    assert claim_in_child(tmp_path, GPU)[0]
    assert os.path.exists(lock_path(GPU, tmp_path))  # never unlinked


def test_a_refused_claim_holds_nothing(tmp_path):
    holder = Holder(tmp_path, OTHER)
    try:
        claim = claim_gpus([GPU, OTHER], tmp_path)
        assert not claim and OTHER in claim.reason
        assert claim_in_child(tmp_path, GPU)[0]  # the first GPU was let go
    finally:
        holder.stop()


def test_claims_in_one_process_share_a_lock_and_count(tmp_path):
    first = claim_gpus([GPU], tmp_path)
    second = claim_gpus(["00000000:3B:00.0"], tmp_path)  # NVML's spelling: the same GPU
    assert first and second
    first.close()
    assert not claim_in_child(tmp_path, GPU)[0]  # still held through the second
    first.close()  # closing twice releases nothing more
    assert not claim_in_child(tmp_path, GPU)[0]
    second.close()
    assert claim_in_child(tmp_path, GPU)[0]


def test_a_split_config_names_a_gpu_twice_and_takes_one_lock(tmp_path):
    with claim_gpus([GPU, GPU], tmp_path) as claim:
        assert claim and claim.addresses == (GPU,)
    assert claim_in_child(tmp_path, GPU)[0]


def test_a_forked_child_leaves_the_parents_lock_in_place(tmp_path):
    claim = claim_gpus([GPU], tmp_path)
    try:
        pid = os.fork()
        if pid == 0:
            os._exit(0)  # the child's copy of the descriptor closes here
        os.waitpid(pid, 0)
        assert not claim_in_child(tmp_path, GPU)[0]
    finally:
        claim.close()
    assert claim_in_child(tmp_path, GPU)[0]


def test_the_lock_file_is_0644_whatever_the_umask(tmp_path):
    old = os.umask(0o077)
    try:
        with claim_gpus([GPU], tmp_path):
            pass
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(lock_path(GPU, tmp_path)).st_mode) == 0o644


def test_a_symlink_is_refused_and_not_followed(tmp_path):
    target = tmp_path / "victim"
    os.symlink(target, lock_path(GPU, tmp_path))
    claim = claim_gpus([GPU], tmp_path)
    assert (
        not claim and "symbolic link" in claim.reason and lock_path(GPU, tmp_path) in claim.reason
    )
    assert not target.exists()


def test_a_symlinked_lock_directory_is_refused(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    os.symlink(real, tmp_path / "link")
    claim = claim_gpus([GPU], tmp_path / "link")
    assert not claim and "lock directory" in claim.reason


def test_a_fifo_is_refused_without_hanging(tmp_path):
    os.mkfifo(lock_path(GPU, tmp_path))
    # In a child: an open that blocked would end in subprocess's TimeoutExpired,
    # not hang the suite.
    held, reason = claim_in_child(tmp_path, GPU)
    assert not held and "not a regular file" in reason


def test_a_directory_is_refused(tmp_path):
    os.mkdir(lock_path(GPU, tmp_path))
    claim = claim_gpus([GPU], tmp_path)
    assert not claim and "not a regular file" in claim.reason


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")


@pytest.fixture
def public_dir():
    """A folder another user can reach, shared as /tmp is (1777; pytest's tmp_path
    is root's alone)."""
    path = tempfile.mkdtemp(prefix="cpupin-lock-")
    os.chmod(path, 0o1777)
    yield Path(path)
    shutil.rmtree(path, ignore_errors=True)


@needs_root
def test_another_users_0600_file_is_refused(public_dir):
    tmp_path = public_dir
    path = lock_path(GPU, tmp_path)
    with open(path, "w"):
        pass
    os.chmod(path, 0o600)
    held, reason = claim_in_child(tmp_path, GPU, uid=NOBODY)
    assert not held and path in reason


@needs_root
def test_a_read_only_directory_refuses_a_new_lock_but_not_an_existing_one(public_dir):
    tmp_path = public_dir
    os.chmod(tmp_path, 0o755)  # root's; nobody cannot create in it
    held, reason = claim_in_child(tmp_path, GPU, uid=NOBODY)
    assert not held and "not writable" in reason and "CPUPIN_LOCK_DIR" in reason
    with claim_gpus([GPU], tmp_path):  # root creates it, 0644
        pass
    assert claim_in_child(tmp_path, GPU, uid=NOBODY)[0]


@pytest.mark.parametrize("err", [errno.ENOLCK, errno.EBADF, errno.EOPNOTSUPP])
def test_a_filesystem_without_locks_means_no_claim(tmp_path, monkeypatch, err):
    def refuse(fd, op):
        raise OSError(err, os.strerror(err))

    monkeypatch.setattr(fcntl, "flock", refuse)
    claim = claim_gpus([GPU, OTHER], tmp_path)
    assert not claim and "cannot lock" in claim.reason and "CPUPIN_LOCK_DIR" in claim.reason
    monkeypatch.undo()
    assert claim_in_child(tmp_path, GPU)[0] and claim_in_child(tmp_path, OTHER)[0]


def test_a_missing_lock_directory_means_no_claim(tmp_path):
    claim = claim_gpus([GPU], tmp_path / "nope")
    assert not claim and "cannot open the lock directory" in claim.reason


@pytest.mark.parametrize("bad", ["../../etc/passwd", "0000:3b:00.0/..", "gpu0", ""])
def test_an_address_is_validated_before_it_reaches_a_path(tmp_path, bad):
    with pytest.raises(ValueError, match="PCI address"):
        claim_gpus([bad], tmp_path)
    assert os.listdir(tmp_path) == []


def test_the_lock_directory_comes_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("CPUPIN_LOCK_DIR", str(tmp_path))
    with claim_gpus([GPU]) as claim:
        assert claim and claim.paths[GPU] == str(tmp_path / f"cpupin-gpu-{GPU}.lock")


# --- the threat model: another user who could rename a lock away ------------


def owned_dir(mode, uid=0):
    path = tempfile.mkdtemp(prefix="cpupin-lock-")
    os.chown(path, uid, -1)
    os.chmod(path, mode)
    return Path(path)


@needs_root
def test_another_users_lock_file_in_a_world_writable_dir_is_refused_naming_the_owner(public_dir):
    path = lock_path(GPU, public_dir)
    with open(path, "w"):
        pass
    os.chown(path, NOBODY, -1)  # nobody could rename it away while we hold it
    claim = claim_gpus([GPU], public_dir)
    assert not claim
    assert f"uid {NOBODY}" in claim.reason and path in claim.reason
    assert "CPUPIN_LOCK_DIR" in claim.reason and "not world-writable" in claim.reason


@needs_root
def test_a_lock_file_of_another_user_in_a_group_shared_dir_is_trusted():
    shared = owned_dir(0o2770)
    try:
        path = lock_path(GPU, shared)
        with open(path, "w"):
            pass
        os.chown(path, NOBODY, -1)
        with claim_gpus([GPU], shared) as claim:
            assert claim, claim.reason
    finally:
        shutil.rmtree(shared)


@needs_root
def test_a_lock_dir_owned_by_another_user_is_refused():
    theirs = owned_dir(0o755, uid=NOBODY)
    try:
        claim = claim_gpus([GPU], theirs)
        assert not claim and f"owned by uid {NOBODY}" in claim.reason
        assert not os.path.exists(lock_path(GPU, theirs))  # nothing created there
    finally:
        shutil.rmtree(theirs)


def test_a_world_writable_dir_without_the_sticky_bit_is_refused(tmp_path):
    os.chmod(tmp_path, 0o777)
    claim = claim_gpus([GPU], tmp_path)
    assert not claim and "sticky bit" in claim.reason and str(tmp_path) in claim.reason
    assert not os.path.exists(lock_path(GPU, tmp_path))


def test_this_users_own_lock_in_a_sticky_world_writable_dir_is_fine(public_dir):
    with claim_gpus([GPU], public_dir) as claim:
        assert claim, claim.reason
        assert os.stat(lock_path(GPU, public_dir)).st_uid == os.geteuid()
