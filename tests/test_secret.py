"""The job's channel secret never crosses the torchrun store."""
import os
import stat
import subprocess
import sys

import pytest
import torch.distributed as dist

from hexrl.comm import secret as js
from hexrl.comm.channel import DealerChannel, RouterChannel
from hexrl.comm.wire import message


def store_pair():
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    return master, dist.TCPStore("127.0.0.1", master.port, is_master=False)


def test_the_secret_is_a_0600_file_and_only_its_fingerprint_is_in_the_store(tmp_path):
    master, rank1 = store_pair()
    old = os.umask(0o022)  # a shared run directory's umask must not widen the file
    try:
        key0 = js.job_secret(master, 0, tmp_path / "run", multi_node=True, env={})
    finally:
        os.umask(old)
    key1 = js.job_secret(rank1, 1, tmp_path / "run", multi_node=True, env={})
    assert key0 == key1 and len(key0) == 32
    path = tmp_path / "run" / js.SECRET_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and path.read_bytes() == key0
    outsider = dist.TCPStore("127.0.0.1", master.port, is_master=False)  # anyone reaching the port
    assert not outsider.check(["hexrl/secret"])  # where the key used to be published
    seen = outsider.get("hexrl/secret_check")
    assert key0 not in seen and seen.decode() == js.fingerprint(key0)
    # the key works: a member's frame is heard, one sealed under a guessed key is not
    router = RouterChannel(key1)
    good, bad = DealerChannel("replica-0", key0), DealerChannel("replica-1", b"g" * 32)
    try:
        endpoint = router.bind("127.0.0.1")
        bad.connect(endpoint)
        good.connect(endpoint)
        assert bad.send(message("error", rank=0, cause="forged"))
        assert good.send(message("heartbeat", rank=0, time=1.0))
        assert router.recv(timeout_s=10)[0] == "replica-0"
    finally:
        router.close()
        good.close()
        bad.close()


def test_a_new_launch_draws_a_new_secret_and_a_stale_file_is_not_taken(tmp_path):
    master, rank1 = store_pair()
    first = js.job_secret(master, 0, tmp_path, multi_node=False, env={})
    second = js.job_secret(master, 0, tmp_path, multi_node=False, env={})
    assert first != second and js.job_secret(rank1, 1, tmp_path, multi_node=False, env={}) == second
    (tmp_path / js.SECRET_FILE).write_bytes(first)  # an old launch's file where rank 0's should be
    with pytest.raises(js.SecretError, match="not the one rank 0 wrote"):
        js.job_secret(rank1, 1, tmp_path, multi_node=False, env={}, file_wait_s=0.3)


def test_a_multi_node_job_without_a_shared_run_dir_or_hexrl_secret_is_refused(tmp_path):
    master, rank1 = store_pair()
    js.job_secret(master, 0, tmp_path / "node0", multi_node=True, env={})
    with pytest.raises(js.SecretError, match="HEXRL_SECRET on every launcher.*shares"):
        js.job_secret(rank1, 1, tmp_path / "node1", multi_node=True, env={}, file_wait_s=0.3)


def test_hexrl_secret_on_every_launcher(tmp_path):
    master, rank1 = store_pair()
    env = {js.SECRET_ENV: "a" * 64}
    key = js.job_secret(master, 0, tmp_path / "node0", multi_node=True, env=env)
    assert js.job_secret(rank1, 1, tmp_path / "node1", multi_node=True, env=env) == key
    assert not (tmp_path / "node0").exists()  # no file written when the user gives the secret
    with pytest.raises(js.SecretError, match="differs from rank 0's"):
        js.job_secret(rank1, 2, tmp_path, multi_node=True, env={js.SECRET_ENV: "b" * 64})
    with pytest.raises(js.SecretError, match="at least 32 characters"):
        js.job_secret(rank1, 3, tmp_path, multi_node=True, env={js.SECRET_ENV: "short"})


def test_a_hexrl_secret_that_is_not_utf8_is_named(tmp_path):
    """A launcher's environment can hold any bytes; os.environ keeps the invalid ones as lone surrogates."""
    master, _ = store_pair()
    env = {js.SECRET_ENV: os.fsdecode(b"\xff\xfe" * 32)}
    with pytest.raises(js.SecretError, match="HEXRL_SECRET is not valid UTF-8"):
        js.job_secret(master, 0, tmp_path, multi_node=False, env=env)
    assert not (tmp_path / js.SECRET_FILE).exists()


def test_a_job_secret_path_that_is_a_directory_is_named_on_every_rank(tmp_path):
    master, rank1 = store_pair()
    (tmp_path / js.SECRET_FILE).mkdir()
    with pytest.raises(js.SecretError, match=f"cannot write the job secret to {tmp_path / js.SECRET_FILE}: "
                                             "Is a directory"):
        js.job_secret(master, 0, tmp_path, multi_node=False, env={})
    assert [p.name for p in tmp_path.iterdir()] == [js.SECRET_FILE]  # no temporary file left behind
    master.set("hexrl/secret_check", js.fingerprint(b"k" * 32))  # as if rank 0 had written it elsewhere
    with pytest.raises(js.SecretError, match=f"{tmp_path / js.SECRET_FILE} is a directory, not the job secret"):
        js.job_secret(rank1, 1, tmp_path, multi_node=False, env={}, file_wait_s=30)


def test_a_bad_hexrl_secret_stops_the_job_with_one_line_per_rank(tmp_path):
    """Every rank reads it: each says what is wrong with it, and no hexrl traceback follows."""
    from runtime_utils import ROOT, write_job

    plan = write_job(tmp_path, steps=1, nproc=2, train_gpus=1)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "hexrl.main",
           str(plan), "--run-dir", str(tmp_path / "run")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", js.SECRET_ENV: os.fsdecode(b"\xff" * 40)}
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = res.stdout + res.stderr
    assert res.returncode != 0
    assert out.count("failed: SecretError: HEXRL_SECRET is not valid UTF-8") == 2, out
    assert f'File "{ROOT / "hexrl"}' not in out, out  # torchrun's summary holds the line, not a traceback
