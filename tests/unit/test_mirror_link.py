"""ckptless.mirror.link: which interface the mirrors use, which the collectives use, what is worth a warning.

Pure decisions with examples and hypothesis; the probe's sockets against the real
loopback (a contract test: the receiver counts what the sender sent).
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from ckptless.mirror.link import (
    MirrorLink,
    ProbeServer,
    _nccl_matches,
    collectives_interface,
    interfaces,
    judge,
    probe,
    resolve,
)

IFACES = {"lo": "127.0.0.1", "eth0": "10.0.0.5", "ib0": "192.168.7.5", "docker0": "172.17.0.1"}


def test_gloo_binds_the_named_interface_then_local_addr_then_the_host_name() -> None:
    assert resolve("ib0", "10.0.0.5", "10.0.0.5", IFACES) == ("ib0", "192.168.7.5", "GLOO_SOCKET_IFNAME")
    assert resolve("ib0,ib1", None, "10.0.0.5", IFACES)[0] == "ib0"
    assert resolve(None, "192.168.7.5", "10.0.0.5", IFACES) == ("ib0", "192.168.7.5", "--local-addr")
    assert resolve(None, None, "10.0.0.5", IFACES) == ("eth0", "10.0.0.5", "the host name")
    assert resolve(None, None, "10.9.9.9", IFACES) == (None, "10.9.9.9", "the host name")  # not a local address


def test_the_collectives_interface_follows_nccl_rules_or_is_the_mirrors_own() -> None:
    assert collectives_interface(False, "ib0", "eth0", IFACES) == "eth0"  # Gloo: bound like the mirrors
    assert collectives_interface(True, None, "eth0", IFACES) == "ib0"  # NCCL's default prefers ib*
    assert collectives_interface(True, None, "eth0", {"lo": "127.0.0.1", "eth0": "10.0.0.5"}) == "eth0"
    assert collectives_interface(True, "eth", "ib0", IFACES) == "eth0"
    assert collectives_interface(True, "^eth,docker,lo", "eth0", IFACES) == "ib0"
    assert collectives_interface(True, "=ib", "eth0", IFACES) is None  # exact: no interface named "ib"


@given(name=st.text(alphabet="abcdefgh0123", min_size=1, max_size=6),
       prefixes=st.lists(st.text(alphabet="abcdefgh0123", min_size=1, max_size=4), min_size=1, max_size=3))
def test_an_excluding_spec_selects_exactly_what_the_including_one_does_not(name: str, prefixes: list[str]) -> None:
    spec = ",".join(prefixes)
    assert _nccl_matches(name, "^" + spec) is not _nccl_matches(name, spec)
    assert _nccl_matches(name, spec) == any(name.startswith(p) for p in prefixes)


def test_warnings_name_both_interfaces_and_the_fix_or_the_rate() -> None:
    link = MirrorLink("eth0", "10.0.0.5", "the host name", "node-b", bytes_per_s=0.05e9 / 8, probe_s=0.3)
    (other, slow) = judge(link, "ib0", min_gbps=1.0)
    assert "the mirrors use eth0" in other and "collectives use ib0" in other and "GLOO_SOCKET_IFNAME=ib0" in other
    assert "0.05 Gb/s" in slow and "CKPTLESS_MIRROR_MIN_GBPS=1" in slow
    assert judge(MirrorLink("ib0", "192.168.7.5", "--local-addr", "b", 100e9 / 8, 0.3), "ib0", 1.0) == []
    assert judge(MirrorLink("ib0", "192.168.7.5", "--local-addr"), None, 1.0) == []  # nothing known: nothing said


def test_a_link_round_trips_through_its_record() -> None:
    link = MirrorLink("eth0", "10.0.0.5", "--local-addr", "node-b", 1.25e9, 0.31)
    assert MirrorLink.from_json(link.to_json()) == link
    failed = MirrorLink("eth0", "10.0.0.5", "--local-addr", "node-b", error="not measured: refused")
    assert MirrorLink.from_json(failed.to_json()) == failed and "not measured" in failed.describe()


def test_the_probe_measures_loopback_and_the_receiver_counts_every_byte() -> None:
    assert interfaces().get("lo") == "127.0.0.1"
    server = ProbeServer("127.0.0.1")
    try:
        rate, secs = probe("127.0.0.1", server.port, seconds=0.05, max_bytes=8 << 20)
    finally:
        server.close()
    received = round(rate * secs)  # what the receiver counted: whole 1 MiB sends, within the byte cap
    assert secs > 0 and received % (1 << 20) == 0 and (1 << 20) <= received <= 8 << 20
