"""spec.engine.parallelism: the engine pod's flags, its GPUs (one per rank) and /dev/shm;
nodes that do not divide the ranks and parallelism flags in extraArgs are refused."""

import pytest

from iterserve.operator import resources as r
from iterserve.operator.validation import parse_spec

OWNER = r.Owner("llm", "team-a", "uid-123")


def _pod(spec):
    return r.build_deployment(OWNER, spec)["spec"]["template"]["spec"]


def test_tensor_and_pipeline_sizes_become_serve_flags_and_gpus_per_rank():
    spec = parse_spec({"model": {"uri": "m"}, "engine": {"parallelism": {"tensor": 2, "pipeline": 2},
                                                         "resources": {"limits": {"nvidia.com/gpu": 1}}}})
    pod = _pod(spec)
    args = pod["containers"][0]["args"]
    assert args[args.index("--tensor-parallel-size") + 1] == "2"
    assert args[args.index("--pipeline-parallel-size") + 1] == "2"
    resources = pod["containers"][0]["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == "4" and resources["requests"]["nvidia.com/gpu"] == "4"
    assert {"name": "dshm", "emptyDir": {"medium": "Memory"}} in pod["volumes"]
    assert {"name": "dshm", "mountPath": "/dev/shm"} in pod["containers"][0]["volumeMounts"]


def test_defaults_render_no_parallelism_flags_and_keep_the_gpus_asked():
    spec = parse_spec({"model": {"uri": "m"}, "engine": {"resources": {"limits": {"nvidia.com/gpu": 2}}}})
    args = _pod(spec)["containers"][0]["args"]
    assert "--tensor-parallel-size" not in args and "--pipeline-parallel-size" not in args
    assert r.container_resources(spec)["limits"]["nvidia.com/gpu"] == "2"
    cpu = parse_spec({"model": {"uri": "m"}, "engine": {"parallelism": {"tensor": 2}}})
    assert "nvidia.com/gpu" not in str(r.container_resources(cpu))


def test_nodes_that_do_not_divide_the_ranks_and_parallelism_in_extra_args_are_refused():
    with pytest.raises(ValueError, match="spec.engine.parallelism.nodes: must divide tensor x pipeline"):
        parse_spec({"model": {"uri": "m"}, "engine": {"parallelism": {"tensor": 3, "nodes": 2}}})
    with pytest.raises(ValueError, match="--tensor-parallel-size"):
        parse_spec({"model": {"uri": "m"}, "engine": {"extraArgs": ["--tensor-parallel-size", "2"]}})
