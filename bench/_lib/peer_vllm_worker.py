"""vLLM's side of bench/engine/prefix.py's peer runs: one offline `vllm.LLM`, kept alive between
the interleaved repeats, driven over a local connection with JSON messages.

Run by the python that has vLLM (bench/_lib/peers.py finds it), not by kvheat's (it
imports nothing from the repo):
    python bench/_lib/peer_vllm_worker.py PORT AUTHKEY_HEX CONFIG_JSON
Requests: {"op": "ttft", "prompts": [[ids]]} (each prompt alone, one token: seconds per
prompt), {"op": "batch", "prompts": [[ids]], "max_tokens": N} (all at once: seconds,
output tokens, the first 8 tokens of each), {"op": "quit"}.
"""

from __future__ import annotations

import json
import sys
import time
from multiprocessing.connection import Client


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    port, key, cfg = int(sys.argv[1]), bytes.fromhex(sys.argv[2]), json.loads(sys.argv[3])
    llm = LLM(model=cfg["model"], dtype=cfg["dtype"], enable_prefix_caching=True,
              enforce_eager=True, max_model_len=cfg["max_model_len"], seed=0,
              max_num_seqs=cfg["max_num_seqs"],
              max_num_batched_tokens=cfg["max_num_batched_tokens"])

    def params(n: int) -> SamplingParams:
        # detokenize=False: kvheat's side has no tokenizer either; ids in, ids out.
        return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, detokenize=False)

    def run(prompts: list[list[int]], n: int) -> list:
        return llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params(n),
                            use_tqdm=False)

    run([list(range(2, 66))], 2)  # warm-up
    conn = Client(("127.0.0.1", port), authkey=key)
    conn.send_bytes(json.dumps({"ready": True}).encode())
    while True:
        msg = json.loads(conn.recv_bytes())
        if msg["op"] == "quit":
            break
        if msg["op"] == "ttft":
            times = []
            for p in msg["prompts"]:
                t0 = time.perf_counter()
                run([p], 1)
                times.append(time.perf_counter() - t0)
            reply = {"ttft_s": times}
        else:
            t0 = time.perf_counter()
            outs = run(msg["prompts"], msg["max_tokens"])
            reply = {"seconds": time.perf_counter() - t0,
                     "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
                     "first_tokens": [list(o.outputs[0].token_ids[:8]) for o in outs]}
        conn.send_bytes(json.dumps(reply).encode())
    conn.close()


if __name__ == "__main__":
    main()
