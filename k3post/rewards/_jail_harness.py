"""Tests against a model-written solution, with the verdict out of the solution's reach.

Two processes of the jail, each a fork of the trusted jail process, each with its own uid:

    judge      (uid J, not dumpable)  reads the tests, runs them, writes "pass i" / "fail i <why>"
                                      on the verdict descriptor that only it holds
    candidate  (uid C)                imports the solution, then answers calls over two pipes

The judge's namespace holds, for each public top-level name of the solution that is not a builtin,
a proxy: calling it sends `{"call": name, "args": [...], "kwargs": {...}}` to the candidate and
decodes the answer. Only values of exact builtin types cross (`encode`/`decode`: None, bool, int,
float, str, list, and tagged tuple, dict, set, frozenset, bytes, complex), so `add(1, 2) == 3` is
evaluated by the judge on an int the judge built itself: an object whose `__eq__` is always true
cannot cross, and the candidate never sees a test, an expected value or the verdict channel. A
result that is not plain data (an instance of the solution's class) stays in the candidate and
crosses as a reference: the judge may call it and read attributes (each answer decoded the same
way), but comparing a reference is identity in the judge.

What the candidate can still do is what any solution can: return values. It cannot patch the
judge's builtins, walk its frames, rewrite its test list or forge its output (different process
and uid; the judge is not dumpable, so not even the same uid could ptrace it or open its fds).

Limits of the scheme: arguments and results are copies (a test that checks an in-place mutation
of its argument sees no change), and arguments must be plain data (no lambdas or test-defined
objects). Stdlib only: this runs under `python -I -S`.
"""

from __future__ import annotations

import builtins
import json
import os

MAX_MESSAGE = 16 * 2**20  # bytes in one answer from the candidate; more fails that call
_PLAIN = (type(None), bool, int, float, str)
_TAGGED = {tuple: "tuple", set: "set", frozenset: "frozenset"}
_FROM_TAG = {"tuple": tuple, "set": set, "frozenset": frozenset}


class RemoteError(Exception):
    """The solution raised an exception that is not a builtin one, or its process failed."""


class Ref:
    """A reference to an object that stays in the candidate (compared by identity here)."""

    def __init__(self, channel: "Channel", ident: int):
        self._channel, self._ident = channel, ident

    def __call__(self, *args, **kwargs):
        return self._channel.request({"ref": self._ident, "args": encode(list(args), self._channel),
                                      "kwargs": encode(kwargs, self._channel)})

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return self._channel.request({"ref": self._ident, "attr": name})

    def __repr__(self) -> str:
        return f"<solution object #{self._ident}>"


def encode(value, refs=None):
    """`value` as JSON-ready data; exact builtin types only. In the candidate, `refs` (a list) keeps
    other objects and encodes their index; in the judge, `refs` is the channel (Ref only)."""
    kind = type(value)
    if kind in _PLAIN:
        return value
    if kind is list:
        return [encode(item, refs) for item in value]
    if kind in _TAGGED:
        return {"$t": _TAGGED[kind], "v": [encode(item, refs) for item in value]}
    if kind is dict:
        return {"$t": "dict", "v": [[encode(k, refs), encode(v, refs)] for k, v in value.items()]}
    if kind is bytes:
        return {"$t": "bytes", "v": value.hex()}
    if kind is complex:
        return {"$t": "complex", "v": [value.real, value.imag]}
    if kind is Ref:
        return {"$t": "ref", "v": value._ident}
    if isinstance(refs, list):
        refs.append(value)
        return {"$t": "ref", "v": len(refs) - 1}
    raise TypeError(f"cannot pass a {kind.__name__} to the solution (plain data only)")


def decode(data, resolve):
    """The inverse of `encode`, strict: anything else is an error. `resolve(int)` makes a ref."""
    kind = type(data)
    if kind in _PLAIN:
        return data
    if kind is list:
        return [decode(item, resolve) for item in data]
    if kind is not dict or set(data) != {"$t", "v"}:
        raise ValueError("malformed value from the solution")
    tag, payload = data["$t"], data["v"]
    if tag in _FROM_TAG and type(payload) is list:
        return _FROM_TAG[tag](decode(item, resolve) for item in payload)
    if tag == "dict" and type(payload) is list and all(type(p) is list and len(p) == 2 for p in payload):
        return {decode(k, resolve): decode(v, resolve) for k, v in payload}
    if tag == "bytes" and type(payload) is str:
        return bytes.fromhex(payload)
    if tag == "complex" and type(payload) is list and len(payload) == 2 and all(type(x) in (int, float) for x in payload):
        return complex(*payload)
    if tag == "ref" and type(payload) is int:
        return resolve(payload)
    raise ValueError(f"malformed value from the solution (tag {tag!r})")


def _raise_remote(name, message):
    error = getattr(builtins, name, None) if type(name) is str else None
    if not (isinstance(error, type) and issubclass(error, Exception)):
        error = RemoteError  # never re-raise SystemExit, KeyboardInterrupt, ... in the judge
    raise error(str(message)[:500])


class Channel:
    """The judge's end of the pipes to the candidate."""

    def __init__(self, call_fd: int, reply_fd: int):
        self.calls = os.fdopen(call_fd, "wb", buffering=0)
        self.replies = os.fdopen(reply_fd, "rb")

    def receive(self):
        line = self.replies.readline(MAX_MESSAGE + 1)
        if not line.endswith(b"\n"):
            raise RemoteError("the solution's process ended or sent too much" if line else "the solution's process ended")
        message = json.loads(line)
        if type(message) is not dict:
            raise ValueError("malformed message from the solution")
        return message

    def request(self, message: dict):
        self.calls.write(json.dumps(message).encode() + b"\n")
        answer = self.receive()
        if "raise" in answer:
            _raise_remote(answer.get("raise"), answer.get("message", ""))
        if set(answer) != {"value"}:
            raise ValueError("malformed answer from the solution")
        return decode(answer["value"], lambda ident: Ref(self, ident))


def _proxy(channel: Channel, name: str):
    def call(*args, **kwargs):
        return channel.request({"call": name, "args": encode(list(args), channel), "kwargs": encode(kwargs, channel)})
    call.__name__ = call.__qualname__ = name
    return call


def run_judge(tests_fd: int, call_fd: int, reply_fd: int, verdict_fd: int) -> None:
    """Run every test in turn; one verdict line each, written as soon as it is known."""
    with os.fdopen(tests_fd, "rb") as handle:
        tests = json.loads(handle.read())
    channel = Channel(call_fd, reply_fd)

    def verdict(text: str) -> None:
        os.write(verdict_fd, (text + "\n").encode())

    try:
        hello = channel.receive()
        names = hello["names"] if set(hello) == {"names"} and type(hello["names"]) is dict else None
        if names is None:
            raise RemoteError(str(hello.get("error", "no names")))
    except Exception as error:  # noqa: BLE001 - the solution did not import: every test fails
        verdict(f"solution-error {type(error).__name__}")
        return
    namespace = {"__name__": "__test__", "__builtins__": builtins}
    for name, spec in names.items():
        if type(name) is str and name.isidentifier() and not name.startswith("__") and not hasattr(builtins, name):
            try:
                namespace[name] = _proxy(channel, name) if spec == "callable" else decode(spec, lambda i: Ref(channel, i))
            except (ValueError, TypeError):
                pass
    for index, test in enumerate(tests):
        try:
            exec(compile(test, f"test_{index}.py", "exec"), namespace)
        except BaseException as error:  # noqa: BLE001 - a failing test is a verdict, not a crash
            verdict(f"fail {index} {type(error).__name__}")
        else:
            verdict(f"pass {index}")


def serve_candidate(solution_fd: int, call_fd: int, reply_fd: int) -> None:
    """Import the solution as module `solution`, announce its names, then answer calls until EOF."""
    with os.fdopen(solution_fd, "rb") as handle:
        source = handle.read().decode("utf-8", errors="replace")
    write = os.write

    def send(message: dict) -> None:
        write(reply_fd, json.dumps(message).encode() + b"\n")

    namespace = {"__name__": "solution", "__builtins__": builtins}
    try:
        exec(compile(source, "solution.py", "exec"), namespace)
    except BaseException as error:  # noqa: BLE001 - reported, then nothing is served
        send({"error": type(error).__name__})
        return
    refs: list = []
    names = {}
    for name, value in list(namespace.items()):
        if name.startswith("__"):
            continue
        if callable(value):
            names[name] = "callable"
        elif type(value) in _PLAIN or type(value) in (list, tuple, dict, set, frozenset):
            try:
                names[name] = encode(value)
            except (TypeError, RecursionError):
                pass
    send({"names": names})
    calls = os.fdopen(call_fd, "rb")
    for line in calls:
        send(_answer(json.loads(line), namespace, refs))


def _answer(message: dict, namespace: dict, refs: list) -> dict:
    try:
        resolve = refs.__getitem__
        if "attr" in message:
            return {"value": encode(getattr(refs[message["ref"]], message["attr"]), refs)}
        target = refs[message["ref"]] if "ref" in message else namespace[message["call"]]
        result = target(*decode(message["args"], resolve), **decode(message["kwargs"], resolve))
        return {"value": encode(result, refs)}
    except Exception as error:  # noqa: BLE001 - the solution's exception goes back to the test
        return {"raise": type(error).__name__, "message": str(error)[:500]}
