"""Ranks on several nodes: ranks of one node map each other's heaps, the others share no memory and meet
through the transport (gloo point-to-point, a progress agent per rank). Nodes are emulated on this machine
by ``launch(..., ranks_per_node=...)``: the ranks of different nodes are processes that map nothing of each
other, as they would on machines of their own."""
import ast
import functools
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import megakernel as mk
from megakernel import bootstrap
from megakernel.bootstrap import Topology

from helpers import SMOLLM2_NEW_TOKENS, SMOLLM2_PROMPT, assert_close, smollm2_path
from test_decode import hf_model, prompt, tensor_parallel_generation
from test_multirank import COLS, ROWS, _collectives_graph, _shm_segments, _TAG, _value, assert_nothing_left, silent_rank

pytestmark = pytest.mark.slow  # several process ranks


def collectives(workers: int):
    """Two runs of every collective (and a put), with their kernel's links and what crosses the network."""
    g = _collectives_graph()
    with mk.Megakernel(g, workers=workers, timeout=60) as kernel:
        outputs = []
        for run in range(2):
            kernel.poison()
            outputs.append(kernel.run({"x": _value(g.rank, run, (ROWS, COLS)),
                                       "big": _value(g.rank, run, (20, 1000), 1)}, steps=2))
        return outputs, kernel.links


# the torch references at 2 nodes x 2 ranks, the tiles under the interpreter at 2 nodes x 1
@pytest.mark.parametrize("world,per_node,host", [(4, 2, "torch"), (2, 1, "cpu")])
def test_collectives_across_nodes_against_torch_and_the_same_bits_on_every_rank(world, per_node, host, monkeypatch):
    monkeypatch.setattr(bootstrap, "_process_backend", host)
    results = mk.launch(functools.partial(collectives, 2), world_size=world, ranks_per_node=per_node, timeout=300)
    for me, (_, links) in enumerate(results):
        assert links == {r: "self" if r == me else "memory" if r // per_node == me // per_node else "gloo"
                         for r in range(world)}
    for run in range(2):
        xs = [_value(r, run, (ROWS, COLS)).double() for r in range(world)]
        bigs = [_value(r, run, (20, 1000), 1).double() for r in range(world)]
        total, big_total, chunk = sum(xs), sum(bigs), COLS // world
        squares = sum(x[:, : chunk * world] ** 2 for x in xs)
        for me in range(world):
            out, what = results[me][0][run], f"rank {me} of {world} ({per_node} a node), run {run}"
            assert torch.equal(out["put"], (xs[(me - 1) % world] + xs[me]).float()), what
            for name in ("one_shot", "two_shot", "auto"):  # auto: hierarchical across nodes
                assert_close(out[name], big_total if name == "auto" else total, 1e-5, f"{name} {what}")
                assert torch.equal(out[name], results[0][0][run][name]), f"{name} differs between rank 0 and {me}"
            assert torch.equal(out["gather0"], torch.cat(xs, 0).float()), what
            assert torch.equal(out["gather1"], torch.cat([x[:, :7] for x in xs], 1).float()), what
            assert_close(out["scatter"], squares[:, me * chunk:(me + 1) * chunk], 1e-5, f"scatter {what}")
            assert_close(out["scatter_rows"], big_total[4 * me: 4 * me + 4], 1e-5, f"scatter_rows {what}")


NETWORK_CASES = {"hierarchical": (None, "all_reduce"), "two_shot": ("two_shot", "all_reduce"),
                 "one_shot": ("one_shot", "all_reduce"), "all_gather": (None, "all_gather")}


def network_payload():
    """Per collective of NETWORK_CASES: the bytes this rank's tiles send over the network per step (headers
    aside) and its result."""
    found = {}
    for name, (algorithm, op) in NETWORK_CASES.items():
        g = mk.Graph()
        x = g.input("x", (4, 1024), torch.float32)
        g.output("y", g.all_reduce(x, algorithm=algorithm) if op == "all_reduce" else g.all_gather(x, dim=1))
        with mk.Megakernel(g, workers=1, timeout=60) as kernel:
            y = kernel.run({"x": torch.full((4, 1024), float(g.rank + 1))})["y"]
            found[name] = sum(size for c in kernel.transport.outgoing for m in c.messages for _, size in m.regions), y
    return found


def test_topology_aware_collectives_send_each_byte_over_the_network_once(monkeypatch):
    monkeypatch.setattr(bootstrap, "_process_backend", "torch")
    nodes, per_node, size = 2, 2, 4 * 1024 * 4  # 2 nodes x 2 ranks, a 16 kB tensor
    expected = {"hierarchical": (nodes - 1) * size // per_node,  # a shard to the other node's counterpart
                "two_shot": 2 * size * per_node // 4,            # a chunk to, then from, each off-node rank
                "one_shot": per_node * size,                     # the whole tensor to each off-node rank
                "all_gather": (nodes - 1) * size}                # one's block to the other node, once
    gathered = torch.cat([torch.full((4, 1024), float(r + 1)) for r in range(4)], 1)
    for rank, found in enumerate(mk.launch(network_payload, world_size=4, ranks_per_node=per_node, timeout=300)):
        for name, (payload, y) in found.items():
            assert payload == expected[name], f"{name}: rank {rank} sends {payload} bytes over the network"
            assert torch.equal(y, gathered if name == "all_gather" else torch.full((4, 1024), 10.0)), name


def test_a_silent_rank_of_another_node_is_named_by_the_watchdog(monkeypatch):
    monkeypatch.setattr(bootstrap, "_process_backend", "torch")  # the transport is the backends' own
    """Rank 1 (node 1) stops its worker for 6 s: rank 0's watchdog names the message that did not come."""
    elapsed, report = mk.launch(silent_rank, world_size=2, ranks_per_node=1, timeout=120)[0]
    assert elapsed < 2 + 5
    assert "on rank 1 (another node)" in report and "has not arrived" in report, report


def killed_rank_of_another_node():
    g = mk.Graph()
    g.output("y", g.all_reduce(g.input("x", (2, 32), torch.float32)))
    with mk.Megakernel(g, workers=1, timeout=30) as kernel:
        kernel.run({"x": torch.randn(2, 32)})
        if g.rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(1)  # rank 1 is gone: its connection broke
        try:
            kernel.run({"x": torch.randn(2, 32)})
        except mk.BackendError as error:
            return str(error)
        return "no error"


def test_a_killed_rank_of_another_node_is_named_and_nothing_is_left(monkeypatch):
    monkeypatch.setenv(*_TAG.decode().split("=", 1))
    before = _shm_segments()
    start = time.monotonic()
    with pytest.raises(mk.BackendError, match="rank 1 died"):
        mk.launch(killed_rank_of_another_node, world_size=2, ranks_per_node=1, timeout=120)
    assert time.monotonic() - start < 60
    assert_nothing_left(before)


def lost_peer(dead: int):
    """Rank ``dead`` kills its own process mid-job; the others report what they saw, from a thread that
    outlives the launcher's reaction (the launcher stops every rank once one died)."""
    g = mk.Graph()
    g.output("y", g.all_reduce(g.input("x", (2, 32), torch.float32)))
    kernel = mk.Megakernel(g, workers=1, timeout=30)
    kernel.run({"x": torch.randn(2, 32)})
    torch.distributed.barrier()  # every rank's first launch checked before one dies
    if g.rank == dead:
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        kernel.run({"x": torch.randn(2, 32)})
    except mk.MegakernelError as error:
        return time.monotonic() - start, f"{type(error).__name__}: {error}"
    return time.monotonic() - start, "no error"


def lost_peer_rank(rank: int, world: int, per_node: int, store: str) -> None:
    """One rank of a job started without ``launch`` (which would stop the others as soon as one died), the
    last rank the one that dies: prints what ``lost_peer`` returned."""
    import torch.distributed as dist
    os.environ.update(LOCAL_WORLD_SIZE=str(per_node), GROUP_RANK=str(rank // per_node))
    bootstrap.set_process_backend("torch")  # the transport is the backends' own
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    print(repr(lost_peer(world - 1)), flush=True)
    os._exit(0)  # the transport's group still has the dead rank's receive posted


@pytest.mark.parametrize("world,per_node", [(2, 1), (4, 2)])
def test_a_lost_peer_of_another_node_stops_every_rank_naming_it(tmp_path, monkeypatch, world, per_node):
    """The last rank dies between launches: every survivor's next launch raises a ``BackendError`` naming it
    well within the watchdog's timeout, whether its transport found it (a channel to it), a rank of its node
    told it (through the headers it maps), or a peer of another node did (a message marked LOSS)."""
    monkeypatch.setenv(*_TAG.decode().split("=", 1))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")]))
    command = "import sys, test_nodes; test_nodes.lost_peer_rank(*map(int, sys.argv[1:4]), sys.argv[4])"
    ranks = [subprocess.Popen([sys.executable, "-c", command, str(r), str(world), str(per_node),
                               str(tmp_path / "store")], stdout=subprocess.PIPE, text=True, start_new_session=True)
             for r in range(world)]
    try:
        outs = [ranks[r].communicate(timeout=120)[0] for r in range(world - 1)]
    finally:
        for process in ranks:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:  # its group ended with it
                pass
            process.wait()
    for rank, out in enumerate(outs):
        elapsed, message = ast.literal_eval(out.strip().splitlines()[-1])
        assert message.startswith("BackendError") and f"rank {world - 1} " in message, (rank, message)
        assert elapsed < 30 / 2, (rank, elapsed)  # the broken connection, not the watchdog, tells


def test_graphs_and_launches_check_the_nodes():
    with pytest.raises(mk.BackendError, match="divides the world size 4"):
        mk.launch(lambda: None, world_size=4, ranks_per_node=3)
    with pytest.raises(mk.BackendError, match="needs process ranks"):
        mk.launch(lambda: None, world_size=2, ranks_per_node=1, virtual=True)
    with pytest.raises(mk.GraphError, match="divides the world size 4"):
        mk.Graph(world_size=4, rank=0, ranks_per_node=0)
    assert mk.Graph(world_size=4, rank=3, ranks_per_node=2).topology == Topology((0, 0, 1, 1))
    assert Topology.uniform(6, 3).node_ranks(1) == [3, 4, 5]


def _small_integers(rank: int) -> torch.Tensor:
    return (rank + 1) * torch.arange(90.0).reshape(3, 30)  # sums of them are exact in float32


def more_nodes_than_there_are():
    """A graph that puts each rank on a node of its own, on one real node: the transport, tested anywhere
    (here 3 nodes of one rank, the collectives' other shape)."""
    g = mk.Graph(ranks_per_node=1)
    x = g.input("x", (3, 30), torch.float32)
    g.output("all_reduce", g.all_reduce(x))
    g.output("all_gather", g.all_gather(x, dim=1))
    g.output("reduce_scatter", g.reduce_scatter(x, dim=0))
    with mk.Megakernel(g, workers=1, timeout=60) as kernel:
        return kernel.links, kernel.run({"x": _small_integers(g.rank)})


def fewer_nodes_than_there_are():
    g = mk.Graph(ranks_per_node=2)  # on 2 nodes of 1
    g.output("y", g.all_reduce(g.input("x", (2, 32), torch.float32)))
    try:
        mk.Megakernel(g, workers=1, timeout=60)
    except mk.BackendError as error:
        return str(error)
    return "built"


def test_a_graph_may_see_more_nodes_than_there_are_never_fewer(monkeypatch):
    monkeypatch.setattr(bootstrap, "_process_backend", "torch")
    results = mk.launch(more_nodes_than_there_are, world_size=3, timeout=300)
    total = sum(_small_integers(r) for r in range(3))
    for rank, (links, out) in enumerate(results):
        assert links == {r: "self" if r == rank else "gloo" for r in range(3)}
        assert torch.equal(out["all_reduce"], total)
        assert torch.equal(out["all_gather"], torch.cat([_small_integers(r) for r in range(3)], 1))
        assert torch.equal(out["reduce_scatter"], total[rank:rank + 1])
    for message in mk.launch(fewer_nodes_than_there_are, world_size=2, ranks_per_node=1, timeout=300):
        assert "on one node, but they are on nodes 0 and 1" in message


# TP 4 over 2 nodes of 2 ranks on the torch backend (the engine around the tiles: paged KV, the sampled
# step, many steps a launch), and TP 2 over 2 nodes of 1 under the interpreter (the tiles themselves: 4 tokens)
@pytest.mark.parametrize("family,world,per_node,batch,host,tokens", [("qwen3", 4, 2, 2, "torch", 12),
                                                                     ("llama", 2, 1, 1, "cpu", 4)])
def test_tensor_parallel_generation_across_nodes_matches_transformers(family, world, per_node, batch, host, tokens,
                                                                      monkeypatch):
    monkeypatch.setattr(bootstrap, "_process_backend", host)
    model = hf_model(family, kv_heads=1 if family == "llama" else 2)
    ids = prompt(batch)
    with torch.no_grad():
        expected = model.generate(ids, max_new_tokens=tokens, do_sample=False, pad_token_id=0)
        reference = model(expected[:, :4]).logits[:, 3].float()
    results = mk.launch(functools.partial(tensor_parallel_generation, family, batch, new_tokens=tokens),
                        world_size=world, ranks_per_node=per_node, timeout=600)
    for rank, (tokens, logits) in enumerate(results):
        assert torch.equal(tokens, expected), f"rank {rank} of {world}, {per_node} a node"
        assert_close(logits, reference, 1e-4, f"rank {rank} of {world}")
        assert torch.equal(logits, results[0][1])


def smollm2_rank():
    from megakernel.serving import from_pretrained
    model = from_pretrained(smollm2_path(), max_seq_len=32, backend="torch", workers=1)
    try:
        tokens = model.generate(SMOLLM2_PROMPT, SMOLLM2_NEW_TOKENS)
        return model.logits[0].clone(), tokens, model.kernel.links
    finally:
        model.close()


def test_smollm2_at_tensor_parallel_4_over_two_nodes_decodes_as_transformers(smollm2):
    """The real checkpoint (its GGUF file as stored) at TP 4, 2 nodes x 2 ranks: transformers' greedy tokens."""
    with torch.no_grad():
        expected = smollm2.generate(SMOLLM2_PROMPT, max_new_tokens=SMOLLM2_NEW_TOKENS, do_sample=False, pad_token_id=0)
        expected_logits = smollm2(expected[:, :-1]).logits[0, -1]
    results = mk.launch(smollm2_rank, world_size=4, ranks_per_node=2, backend="torch", timeout=600)
    for rank, (logits, tokens, links) in enumerate(results):
        assert list(links.values()).count("gloo") == 2, links
        error = (logits - expected_logits).abs().max().item()
        assert error <= 1e-4 * expected_logits.abs().max().item(), f"rank {rank}: logits off by {error}"
        assert torch.equal(tokens, expected), f"rank {rank}: {tokens.tolist()} vs transformers {expected.tolist()}"
