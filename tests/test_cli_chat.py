"""`pagedllm chat` in a terminal: a real process on a pty (so Ctrl-C is a real SIGINT from the terminal),
the real default model. Nothing about timing is asserted, only the order in which things appear."""

import os
import pty
import select
import sys
import time

import pytest

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs a pty")

ARGV = [sys.executable, "-m", "pagedllm.entrypoints.cli.main", "chat", "--temperature", "0"]
ARGV += ["--max-tokens", "200", "--num-kv-blocks", "64", "--quantization", "none"]


class Terminal:
    """The child's terminal: everything it printed (stdout and stderr share the pty), and each read."""

    def __init__(self):
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: a session leader with the pty as its controlling terminal
            os.execv(sys.executable, ARGV)
        self.text = ""
        self.reads: list[str] = []

    def send(self, data: bytes) -> None:
        os.write(self.fd, data)

    def read_once(self, timeout: float) -> str:
        ready, _, _ = select.select([self.fd], [], [], timeout)
        if not ready:
            return ""
        try:
            chunk = os.read(self.fd, 4096).decode(errors="replace")
        except OSError:  # EIO: the child closed the terminal
            chunk = ""
        self.text += chunk
        self.reads.append(chunk)
        return chunk

    def wait_for(self, needle: str, start: int, timeout: float = 300) -> int:
        """Reads until `needle` appears at or after offset `start`; returns where it ends."""
        deadline = time.monotonic() + timeout
        while needle not in self.text[start:]:
            assert time.monotonic() < deadline, f"no {needle!r} after {self.text[start:]!r}"
            if not self.read_once(1.0) and os.waitpid(self.pid, os.WNOHANG) != (0, 0):
                raise AssertionError(f"exited before {needle!r}: {self.text!r}")
        return self.text.index(needle, start) + len(needle)

    def exit_status(self, timeout: float = 60) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.read_once(0.2)
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                return os.waitstatus_to_exitcode(status)
        raise AssertionError(f"still running: {self.text[-500:]!r}")

    def close(self) -> None:
        try:
            os.kill(self.pid, 9)
            os.waitpid(self.pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
        os.close(self.fd)


def test_chat_streams_stops_on_ctrl_c_and_leaves_on_ctrl_d():
    term = Terminal()
    try:
        pos = term.wait_for("/reset", 0)  # the banner names the commands
        assert "quantization none" in term.text and "SmolLM2" in term.text
        pos = term.wait_for("you> ", pos)

        # streaming: the answer arrives in pieces, several reads before the next prompt
        term.send(b"What is the capital of France?\n")
        start = term.wait_for("assistant> ", pos)
        first_read = len(term.reads)
        pos = term.wait_for("you> ", start)
        answer = term.text[start : pos - len("you> ")]
        pieces = [r for r in term.reads[first_read:] if r.strip() and "you> " not in r]
        assert "Paris" in answer
        assert len(pieces) >= 2, term.reads[first_read:]

        # Ctrl-C during an answer stops that answer only
        term.send(b"Write a long story about a dragon who learns to fly.\n")
        start = term.wait_for("assistant> ", pos)
        term.wait_for(" ", start)  # some of the answer is out: it is running
        term.send(b"\x03")
        pos = term.wait_for("(answer stopped)", start)
        pos = term.wait_for("you> ", pos)

        term.send(b"/reset\n")
        pos = term.wait_for("(history cleared)", pos)
        pos = term.wait_for("you> ", pos)
        term.send(b"What is the capital of France?\n")
        start = term.wait_for("assistant> ", pos)
        pos = term.wait_for("you> ", start)
        assert "Paris" in term.text[start:pos]

        term.send(b"\x04")  # Ctrl-D at the prompt
        assert term.exit_status() == 0
        assert "Traceback" not in term.text, term.text
    finally:
        term.close()


@pytest.fixture(scope="module")
def llm():
    from pagedllm.entrypoints.llm import LLM

    return LLM("default", num_kv_blocks=64, quantization="none", show_progress=False)


def test_llm_chat_output_carries_the_rendered_prompt(llm):
    from pagedllm.sampling_params import SamplingParams

    messages = [{"role": "user", "content": "Hi!"}]
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0]
    rendered = llm.get_tokenizer().apply_chat_template(messages, add_generation_prompt=True)
    assert out.prompt == rendered and "Hi!" in out.prompt
    assert out.prompt_token_ids == llm.get_tokenizer().encode(rendered, add_special_tokens=False)


def test_llm_stream_yields_deltas_that_add_up_to_generate(llm):
    from pagedllm.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=24)
    pieces = list(llm.stream("The capital of France is", params))
    whole = llm.generate("The capital of France is", params, use_tqdm=False)[0].outputs[0]
    assert len(pieces) > 1 and pieces[-1].finished and not any(p.finished for p in pieces[:-1])
    assert "".join(p.outputs[0].text for p in pieces if p.outputs) == whole.text
    assert [t for p in pieces if p.outputs for t in p.outputs[0].token_ids] == whole.token_ids
    assert pieces[-1].outputs[0].finish_reason == whole.finish_reason

    chat = list(
        llm.stream_chat([{"role": "user", "content": "Hi!"}], SamplingParams(temperature=0, max_tokens=2))
    )
    assert chat[-1].prompt.endswith("assistant\n")  # SmolLM2's template: the assistant turn is open


def test_llm_stream_closed_early_aborts_its_request(llm):
    from pagedllm.sampling_params import SamplingParams

    stream = llm.stream("Once upon a time", SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
    next(stream)
    assert llm.llm_engine.has_unfinished_requests()
    stream.close()
    assert not llm.llm_engine.has_unfinished_requests()
