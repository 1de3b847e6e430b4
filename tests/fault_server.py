"""`iterserve serve` with a fault planted, for the fault-isolation tests (tests/integration/
test_server_faults.py): `python tests/fault_server.py FAULT serve [options]`.

FAULT is one of
  sampler-tag  sampling raises for every batch holding a request whose prompt contains FAULT-TAG,
               as a sampler bug that one request's settings trigger would;
  engine-kill  the executor raises (a fault no single request owns, like a failed forward pass)
               in any step that schedules a prompt containing KILL-ENGINE;
  slow-load    loading the model takes 120 s longer.
  steered-tools  the fake model's chat template shows it the tools (so tool_choice "auto" parses its
               output for calls), and a prompt containing STEER-TOOLS:NAME gets STEERED_OUTPUTS[NAME]
               as its answer, then EOS: the output an attacker who can steer a model's text would
               get from it, fed to the server's tool-call parser.
The server is otherwise the real one, in its own process.
"""

from __future__ import annotations

import json
import re
import sys
import time

# Each about 20 KB: the quadratic regex the parser used to be took 17 s on 20 KB of spaces, on the
# event loop; the nested one raised RecursionError (a 500).
STEER_SIZE = 20_000
STEERED_OUTPUTS = {
    "spaces-unclosed": "<tool_call>x" + " " * STEER_SIZE + "x",
    "spaces-closed": "<tool_call>{" + " " * STEER_SIZE + "}</tool_call>",
    "nested": "<tool_call>" + "[" * STEER_SIZE,
    "many-blocks": '<tool_call>{"name": "f"}</tool_call> ' * (STEER_SIZE // 36),
}
_STEER = re.compile(r"STEER-TOOLS:([a-z-]+)")
FAKE_EOS = 256


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
    elif fault == "steered-tools":
        _plant_steered_tools()
    else:
        raise SystemExit(f"unknown fault {fault!r}")


def _plant_steered_tools() -> None:
    from iterserve.engine.fake_executor import FakeExecutor, FakeTokenizer

    render = FakeTokenizer.apply_chat_template

    def render_with_tools(self, messages, add_generation_prompt=True, tools=None):
        offered = [t["function"]["name"] for t in tools or ()]
        return (f"tools: {json.dumps(offered)}\n" if offered else "") + render(self, messages, add_generation_prompt)

    FakeTokenizer.chat_template = "{{ tools }} {{ messages }}"  # reads `tools`: "auto" is allowed
    FakeTokenizer.apply_chat_template = render_with_tools
    execute = FakeExecutor.execute

    def steered_execute(self, out):
        tokens = execute(self, out)
        for i, chunk in enumerate(out.chunks):
            found = _STEER.search(chunk.seq.prompt or "") if isinstance(tokens[i], int) else None
            if found:
                text = STEERED_OUTPUTS[found.group(1)].encode()
                k = len(chunk.seq.output_token_ids)
                tokens[i] = text[k] if k < len(text) else FAKE_EOS
        return tokens

    FakeExecutor.execute = steered_execute


if __name__ == "__main__":
    plant(sys.argv[1])  # first: the server binds LLMEngine.from_config when its modules are imported
    from iterserve.cli import main

    sys.exit(main(sys.argv[2:]))
