"""The job's channel secret never crosses the torchrun store (issue 44, item 1)."""
import os
import stat

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
