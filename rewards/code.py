"""Code correctness: run the completion's Python against assert tests, in the sandbox.

    tests_pass(prompt: str, completion: str, meta: dict, timeout_s: float = 3.0,
               all_or_nothing: bool = False, memory_mb: int = 512,
               require_isolation: bool | list[str] = False) -> dict[str, float]

meta["tests"]: a list of test snippets, usually one assert each ("assert add(1, 2) == 3"); a
single string is one test. The solution is the first ```python (or ```py) fenced block of the
completion.

Returns {"reward", "passed", "total", "timed_out", "no_code"}:
- reward = passed / total (partial credit, a denser signal for RL), or with
  all_or_nothing=True 1.0 iff every test passed. No code block, a solution that raises on
  import, a timeout before any test: 0.
- The program runs in k3post.rewards.sandbox (no network, read-only host, private tmp, a fresh
  unprivileged uid, rlimits, wall-clock timeout for the whole run): see docs/rewards.md. What
  holds depends on the host (root, a non-root user with user namespaces, neither).
- require_isolation: true (or a list of layers, e.g. [pid, network, filesystem, cgroup_memory])
  makes the reward fail closed: where the host cannot provide them the code is never run and the
  call raises SandboxIsolationError, which the reward pool logs as a failed reward (0) for every
  sample, instead of scoring in a weaker sandbox.

How a pass is counted (k3post.rewards.sandbox.run_tests). The tests run in a judge process that
never runs the solution's code; the solution is imported (as module `solution`, so an
`if __name__ == "__main__":` block does not run) in another process with another uid, and the
judge reaches it only through calls whose arguments and results cross as plain data of exact
builtin types. `assert add(1, 2) == 3` is then evaluated by the judge on an int it built itself:
patching builtins, walking frames, rewriting the test list, forging output or returning an
object whose `__eq__` is always true cannot pass a test the solution's values fail. Names of the
solution that shadow builtins are not taken into the tests' namespace. A test that raises, is
never reached (timeout, crash, os._exit in the solution) or calls a solution that failed to
import does not pass. Tests must pass plain data to the solution (no lambdas) and cannot see
in-place mutation of their arguments (the solution gets a copy).

    rewards:
      - {fn: "rewards.code:tests_pass", kwargs: {timeout_s: 5, require_isolation: true}}
"""

from __future__ import annotations

import re

from k3post.rewards.sandbox import SandboxLimits, run_tests

CODE_BLOCK = re.compile(r"```(?:python3?|py)[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)

def extract_code(completion: str) -> str | None:
    """The first ```python / ```py fenced block of the completion, or None."""
    match = CODE_BLOCK.search(completion)
    return match.group(1) if match else None


def tests_pass(
    prompt: str,
    completion: str,
    meta: dict,
    timeout_s: float = 3.0,
    all_or_nothing: bool = False,
    memory_mb: int = 512,
    require_isolation: bool | list[str] = False,
) -> dict[str, float]:
    if "tests" not in meta:
        raise KeyError("rewards.code:tests_pass needs meta['tests'] (a list of assert statements)")
    tests = [meta["tests"]] if isinstance(meta["tests"], str) else [str(test) for test in meta["tests"]]
    total = len(tests)
    code = extract_code(completion)
    if code is None or total == 0:
        return {"reward": 0.0, "passed": 0.0, "total": float(total), "timed_out": 0.0, "no_code": float(code is None)}
    limits = SandboxLimits(timeout_s=timeout_s, memory_bytes=memory_mb * 2**20)
    require = require_isolation if isinstance(require_isolation, bool) else tuple(require_isolation)
    verdicts, result = run_tests(code, tests, limits, require_isolation=require)
    passed = sum(verdicts)
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
