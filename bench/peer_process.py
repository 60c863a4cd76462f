"""Run a benchmark peer in a Python process of its own and talk to it in JSON lines.

Two versions of one library cannot be imported into one interpreter under the same name (FlashInfer 0.6.13
and 0.7.x are both ``flashinfer``), so ``bench_fwd.py`` runs FlashInfer 0.7 in a child process with its own
``sys.path``. The protocol is deliberately small:

* The child gets a private copy of its original stdout for the messages and points file descriptor 1 at its
  stderr, so whatever the libraries print cannot corrupt the channel (it shows up in the parent's stderr);
  a line that is not a JSON object (printed before that switch) is passed on to the parent's stderr.
* Every message is one JSON object on one line. The child sends a hello first (``{"ready": true, ...}``, or
  ``{"error": "..."}`` and it exits), then exactly one reply per request; a request that raised gets
  ``{"error": "...", "traceback": "..."}`` and the child carries on. It exits at end of input or on
  ``{"quit": true}``.
* The parent reads the channel in a thread, so every wait has a timeout; a child that died or timed out is
  reported as :class:`PeerError` and the parent goes on without it.

Only one side talks at a time and the parent waits for each reply, so the two processes never run GPU
work at the same time (timings stay clean).
"""

import json
import os
import queue
import subprocess
import sys
import threading
import traceback


class PeerError(RuntimeError):
    """The peer process said no, died, or did not answer in time."""


class PeerProcess:
    """Parent side: start ``cmd`` and exchange messages with it."""

    def __init__(self, cmd, name, env=None, cwd=None):
        self.name = name
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, cwd=cwd,
                                     text=True, bufsize=1)
        self._inbox = queue.Queue()
        self.hello = None
        self.dead = None  # why the peer can no longer be used, once it cannot
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self):
        for line in self.proc.stdout:
            line = line.strip()
            if not line:
                continue
            try:
                msg = json.loads(line)
            except json.JSONDecodeError:
                msg = None
            if isinstance(msg, dict):
                self._inbox.put(msg)
            else:  # printed before the child took over its stdout: pass it on
                print(f"[{self.name}] {line}", file=sys.stderr, flush=True)
        self._inbox.put(None)  # end of the channel: the child exited

    def _receive(self, timeout):
        try:
            msg = self._inbox.get(timeout=timeout)
        except queue.Empty:
            self.dead = f"{self.name} sent nothing for {timeout:.0f} s"
            self.close(kill=True)
            raise PeerError(self.dead) from None
        if msg is None:
            code = self.proc.wait()
            self.dead = f"{self.name} exited (status {code})"
            raise PeerError(self.dead)
        return msg

    def wait_ready(self, timeout=600.0):
        """The child's hello (it raises PeerError if the child could not start)."""
        if self.hello is None:
            msg = self._receive(timeout)
            if not msg.get("ready"):
                self.dead = f"{self.name} did not start: {msg.get('error', msg)}\n{msg.get('traceback', '')}"
                self.close()
                raise PeerError(self.dead)
            self.hello = msg
        return self.hello

    def request(self, msg, timeout=600.0):
        """Send one request and return the reply (a reply may carry "error": that request failed)."""
        if self.dead:
            raise PeerError(self.dead)
        self.wait_ready(timeout)
        try:
            self.proc.stdin.write(json.dumps(msg) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as err:
            self.dead = f"{self.name} is gone: {err}"
            raise PeerError(self.dead) from None
        return self._receive(timeout)

    def close(self, kill=False):
        """Ask the child to quit (or kill it) and reap it."""
        if self.proc.poll() is None:
            if kill:
                self.proc.kill()
            else:
                try:
                    self.proc.stdin.write(json.dumps({"quit": True}) + "\n")
                    self.proc.stdin.close()
                except (BrokenPipeError, OSError):
                    pass
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def serve(setup, handle):
    """Child side: ``setup()`` returns the hello's fields (or raises), then ``handle(request)`` answers
    each request with a dict. Returns the process exit status."""
    sys.stdout.flush()
    channel = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # from here on, prints and library output go to stderr

    def send(msg):
        channel.write(json.dumps(msg) + "\n")
        channel.flush()

    def failure(err):
        return {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc(limit=20)}

    try:
        hello = setup()
    except Exception as err:  # noqa: BLE001 - reported to the parent, which carries on without this peer
        send(failure(err))
        return 1
    send({"ready": True, **hello})
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        if req.get("quit"):
            break
        try:
            reply = handle(req)
        except Exception as err:  # noqa: BLE001 - one failed request is reported, the next may work
            reply = failure(err)
        send(reply)
    return 0
