"""`iterserve serve` with a fault planted, for the fault-isolation tests (tests/integration/
test_server_faults.py): `python tests/fault_server.py FAULT serve [options]`.

FAULT is one of
  sampler-tag  sampling raises for every batch holding a request whose prompt contains FAULT-TAG,
               as a sampler bug that one request's settings trigger would;
  engine-kill  the executor raises (a fault no single request owns, like a failed forward pass)
               in any step that schedules a prompt containing KILL-ENGINE;
  slow-load    loading the model takes 120 s longer.
The server is otherwise the real one, in its own process.
"""

from __future__ import annotations

import sys
import time


def plant(fault: str) -> None:
    if fault == "sampler-tag":
        from iterserve.engine.sampler import Sampler

        sample_batch = Sampler.sample_batch

        def faulty_sample_batch(self, logits, seqs):
            if any("FAULT-TAG" in (seq.prompt or "") for seq in seqs):
                raise RuntimeError("planted sampler fault")
            return sample_batch(self, logits, seqs)

        Sampler.sample_batch = faulty_sample_batch
    elif fault == "engine-kill":
        from iterserve.engine.fake_executor import FakeExecutor

        execute = FakeExecutor.execute

        def faulty_execute(self, out):
            if any("KILL-ENGINE" in (chunk.seq.prompt or "") for chunk in out.chunks):
                raise RuntimeError("planted forward-pass fault")
            return execute(self, out)

        FakeExecutor.execute = faulty_execute
    elif fault == "slow-load":
        from iterserve.engine.llm_engine import LLMEngine

        from_config = LLMEngine.from_config.__func__

        def slow_from_config(cls, config, clock=time.monotonic):
            time.sleep(120)
            return from_config(cls, config, clock)

        LLMEngine.from_config = classmethod(slow_from_config)
    else:
        raise SystemExit(f"unknown fault {fault!r}")


if __name__ == "__main__":
    plant(sys.argv[1])  # first: the server binds LLMEngine.from_config when its modules are imported
    from iterserve.cli import main

    sys.exit(main(sys.argv[2:]))
