#!/usr/bin/env python3
"""Where a vLLM engine in sleep mode stalls on a GPU: build one engine of a tiny random Llama in
one of three set-ups and time each phase (build, sleep, wake, generate).

    python3 tools/vllm_gpu/sleep_probe.py own-sleep|own|inproc-sleep [--compile] [--after SECONDS]

own-sleep     engine core in a process of its own, enable_sleep_mode (what `vllm.sleep` builds)
own           engine core in a process of its own, no sleep mode
inproc-sleep  engine core in this process, enable_sleep_mode

A watchdog, after --after seconds, sends SIGABRT to every child process (PYTHONFAULTHANDLER=1,
set here, makes each print its Python stacks) and dumps this process's stacks, then exits 2: a
stall leaves the line it stalled on in the log instead of a silent timeout.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import signal
import sys
import threading
import time

T0 = time.perf_counter()


def log(*parts) -> None:
    print(f"[sleep-probe {time.perf_counter() - T0:6.1f}s]", *parts, flush=True)


def watchdog(seconds: float) -> None:
    def fire() -> None:
        import psutil  # noqa: PLC0415 (vLLM's own dependency)

        log(f"watchdog: still running after {seconds:.0f} s; stacks follow")
        for child in psutil.Process().children(recursive=True):
            log(f"watchdog: SIGABRT to child {child.pid} {' '.join(child.cmdline())[:120]}")
            try:
                os.kill(child.pid, signal.SIGABRT)
            except ProcessLookupError:
                pass
        time.sleep(3)
        faulthandler.dump_traceback(all_threads=True)
        os._exit(2)

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()


def tiny_model(directory: str) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM  # noqa: PLC0415

    import torch  # noqa: PLC0415

    config = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(directory)
    return directory


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("setup", choices=["own-sleep", "own", "inproc-sleep"])
    parser.add_argument("--compile", action="store_true", help="torch.compile + CUDA graphs (default: eager)")
    parser.add_argument("--after", type=float, default=90.0, help="watchdog seconds")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "INFO")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if args.setup.startswith("inproc") else "1"
    watchdog(args.after)
    import torch  # noqa: PLC0415

    model = tiny_model(f"/tmp/sleep-probe-{args.setup}")
    log("model saved; importing vllm")
    import vllm  # noqa: PLC0415

    log(f"vllm {vllm.__version__}; cuda initialised in this process: {torch.cuda.is_initialized()}")
    sleep = args.setup.endswith("sleep")
    started = time.perf_counter()
    llm = vllm.LLM(model=model, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=256,
                   gpu_memory_utilization=0.3, kv_cache_memory_bytes=2**29, enforce_eager=not args.compile,
                   enable_sleep_mode=sleep, generation_config="vllm")
    log(f"built in {time.perf_counter() - started:.1f} s; free {torch.cuda.mem_get_info()[0] / 2**30:.2f} GiB")
    params = vllm.SamplingParams(max_tokens=16, temperature=1.0, seed=0, logprobs=0, detokenize=False)
    prompts = [vllm.inputs.TokensPrompt(prompt_token_ids=[1, 5, 9, 13 + i]) for i in range(4)]
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    log(f"generated {sum(map(len, first))} tokens")
    if sleep:
        for phase, call in (("sleep", lambda: llm.sleep(level=1)), ("wake", llm.wake_up)):
            started = time.perf_counter()
            call()
            log(f"{phase} {time.perf_counter() - started:.2f} s; free {torch.cuda.mem_get_info()[0] / 2**30:.2f} GiB")
        again = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        log(f"same tokens after sleep and wake: {again == first}")
    log("PROBE OK")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONFAULTHANDLER", "1")  # inherited by the engine core's process
    faulthandler.enable()
    sys.exit(main())
