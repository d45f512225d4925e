"""Hosts as Linux network namespaces, for tests of gpulane across machines.

A dedicated namespace holds a bridge; each host namespace gets one veth into it, with
an address on a private /24 that exists only on these links. Nothing is routed
anywhere else. :meth:`Hosts.cleanup` deletes every namespace (and with them every
link and qdisc), and is safe to call twice or after a half-built setup.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Sequence

__all__ = ["Hosts", "netns_unavailable"]

SUBNET = "10.231.13"


def netns_unavailable() -> str | None:
    """Why these tests cannot run here, or None."""
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "needs iproute2 (ip, tc)"
    probe = subprocess.run(["ip", "netns", "list"], check=False, capture_output=True)
    if probe.returncode != 0:
        return f"`ip netns` unavailable: {probe.stderr.decode().strip()}"
    return None


def _ip(*args: str, ns: str | None = None) -> None:
    argv = ["ip", *(["netns", "exec", ns, "ip"] if ns else []), *args]
    subprocess.run(argv, check=True, capture_output=True)


class Hosts:
    """Namespaces ``<prefix>-<host>`` joined by a bridge in ``<prefix>-net``."""

    def __init__(self, prefix: str, names: Sequence[str]) -> None:
        self.prefix = prefix
        self.bridge_ns = f"{prefix}-net"
        self.names = list(names)
        self.address = {name: f"{SUBNET}.{i + 1}" for i, name in enumerate(self.names)}

    def ns(self, host: str) -> str:
        return f"{self.prefix}-{host}"

    def _veth(self, host: str) -> str:
        return f"v{self.names.index(host)}"  # the bridge side of the host's link

    def build(self) -> Hosts:
        _ip("netns", "add", self.bridge_ns)
        _ip("link", "add", "br0", "type", "bridge", ns=self.bridge_ns)
        _ip("link", "set", "br0", "up", ns=self.bridge_ns)
        for host in self.names:
            ns = self.ns(host)
            _ip("netns", "add", ns)
            veth = self._veth(host)
            _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns,
                ns=self.bridge_ns)  # fmt: skip
            _ip("link", "set", veth, "master", "br0", "up", ns=self.bridge_ns)
            _ip("addr", "add", f"{self.address[host]}/24", "dev", "eth0", ns=ns)
            _ip("link", "set", "eth0", "up", ns=ns)
            _ip("link", "set", "lo", "up", ns=ns)
        return self

    def cut(self, host: str) -> None:
        """Unplug the host's cable (at the bridge)."""
        _ip("link", "set", self._veth(host), "down", ns=self.bridge_ns)

    def heal(self, host: str) -> None:
        _ip("link", "set", self._veth(host), "up", ns=self.bridge_ns)

    def degrade(self, host: str, netem: str) -> None:
        """``tc netem`` on the host's interface, e.g. ``"delay 50ms loss 1%"``."""
        argv = ["ip", "netns", "exec", self.ns(host), "tc", "qdisc", "replace", "dev", "eth0",
                "root", "netem", *netem.split()]  # fmt: skip
        subprocess.run(argv, check=True, capture_output=True)

    def netem_available(self, host: str) -> bool:
        """Whether the kernel has sch_netem (some sandboxed kernels do not)."""
        try:
            self.degrade(host, "delay 1ms")
        except subprocess.CalledProcessError:
            return False
        self.clear(host)
        return True

    def clear(self, host: str) -> None:
        argv = ["ip", "netns", "exec", self.ns(host), "tc", "qdisc", "del", "dev", "eth0", "root"]
        subprocess.run(argv, check=False, capture_output=True)

    def command(self, host: str, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside the host's namespace."""
        return ["ip", "netns", "exec", self.ns(host), *argv]

    def cleanup(self) -> None:
        for ns in [*(self.ns(h) for h in self.names), self.bridge_ns]:
            subprocess.run(["ip", "netns", "delete", ns], check=False, capture_output=True)
