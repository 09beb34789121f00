"""Code correctness: run the completion's Python against assert tests, in the sandbox.

    tests_pass(prompt: str, completion: str, meta: dict, timeout_s: float = 3.0,
               all_or_nothing: bool = False, memory_mb: int = 512) -> dict[str, float]

meta["tests"]: a list of test snippets, usually one assert each ("assert add(1, 2) == 3"); a
single string is one test. The solution is the first ```python (or ```py) fenced block of the
completion.

Returns {"reward", "passed", "total", "timed_out", "no_code"}:
- reward = passed / total (partial credit, a denser signal for RL), or with
  all_or_nothing=True 1.0 iff every test passed. No code block, a solution that raises on
  import, a timeout before any test: 0.
- The program runs in k3post.rewards.sandbox (no network, read-only host, private tmp, a fresh
  unprivileged uid, rlimits, wall-clock timeout for the whole run): see docs/rewards.md.

How a pass is counted. One process runs the solution (with __name__ == "solution", so an
`if __name__ == "__main__":` block that waits for input does not run), then each test in turn
in the solution's namespace, printing "<nonce> pass <i>" after each test that returns. The
nonce is random per call and the program file deletes itself before the solution runs, so
printing pass lines, exiting early with status 0 (os._exit(0), sys.exit(0)), or crashing the
harness scores 0 for the tests not reached. Not prevented: a solution written to attack the
harness from the inside (walking the interpreter's frames to find the nonce, patching
builtins that the tests use). The sandbox protects the host, not the reward, from such code.

    rewards:
      - {fn: "rewards.code:tests_pass", kwargs: {timeout_s: 5}}
"""

from __future__ import annotations

import re
import secrets

from k3post.rewards.sandbox import SandboxLimits, run_python

CODE_BLOCK = re.compile(r"```(?:python3?|py)[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)

HARNESS = '''
def _k3post_harness(nonce, solution, tests):
    import os, sys
    write, out = os.write, os.dup(1)  # our own references: patching os or closing stdout won't hide them
    os.remove(sys.argv[0])  # nothing on disk names the nonce any more
    namespace = {"__name__": "solution"}
    try:
        exec(compile(solution, "solution.py", "exec"), namespace)
    except BaseException as error:
        write(out, ("%s solution-error %s\\n" % (nonce, type(error).__name__)).encode())
        return
    for index, test in enumerate(tests):
        try:
            exec(compile(test, "test_%d.py" % index, "exec"), namespace)
        except BaseException as error:
            write(out, ("%s fail %d %s\\n" % (nonce, index, type(error).__name__)).encode())
        else:
            write(out, ("%s pass %d\\n" % (nonce, index)).encode())
'''


def extract_code(completion: str) -> str | None:
    """The first ```python / ```py fenced block of the completion, or None."""
    match = CODE_BLOCK.search(completion)
    return match.group(1) if match else None


def count_passes(stdout: str, nonce: str, total: int) -> int:
    """Distinct test indices reported as passed on lines that carry the nonce."""
    passed = set()
    for line in stdout.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[0] == nonce and parts[1] == "pass" and parts[2].isdigit():
            passed.add(int(parts[2]))
    return len(passed & set(range(total)))


def tests_pass(
    prompt: str,
    completion: str,
    meta: dict,
    timeout_s: float = 3.0,
    all_or_nothing: bool = False,
    memory_mb: int = 512,
) -> dict[str, float]:
    if "tests" not in meta:
        raise KeyError("rewards.code:tests_pass needs meta['tests'] (a list of assert statements)")
    tests = [meta["tests"]] if isinstance(meta["tests"], str) else [str(test) for test in meta["tests"]]
    total = len(tests)
    code = extract_code(completion)
    if code is None or total == 0:
        return {"reward": 0.0, "passed": 0.0, "total": float(total), "timed_out": 0.0, "no_code": float(code is None)}
    nonce = secrets.token_hex(16)
    program = f"{HARNESS}\n_k3post_harness({nonce!r}, {code!r}, {tests!r})\n"
    result = run_python(program, SandboxLimits(timeout_s=timeout_s, memory_bytes=memory_mb * 2**20))
    passed = count_passes(result.stdout, nonce, total)
    if all_or_nothing:
        reward = 1.0 if passed == total else 0.0
    else:
        reward = passed / total
    return {
        "reward": reward,
        "passed": float(passed),
        "total": float(total),
        "timed_out": float(result.timed_out),
        "no_code": 0.0,
    }
