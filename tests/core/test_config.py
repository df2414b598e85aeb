"""RECCL_* configuration, NIC discovery, backup choice and `reccl topo`.

docs/design.md §12: configuration by RECCL_* variables; an unknown name or a bad value
is an error naming the valid choices. §2: backup NIC = nearest other NIC by
distance cost (PCIe switch +1, root complex +100, NUMA +200), ties spread evenly.
"""
from __future__ import annotations

import dataclasses
import json
import os

import pytest

import torch_reccl
from torch_reccl import cli
from torch_reccl.backend import Options
from torch_reccl.settings import DOC_BEGIN, DOC_END, markdown, settings
from torch_reccl.transport import _C, ConfigError, Transport

from conftest import BACKUP, NICS, PRIMARY, REPO, reccl_env, testing as load_testing

_testing = load_testing()  # decode_handle, choose_backups

pytestmark = [pytest.mark.timeout(30), pytest.mark.usefixtures("healed_nics")]

DOC = os.path.join(REPO, "docs",
                   "configuration.md")
SETTINGS = {s["name"]: s for s in settings()}
NAMES = list(SETTINGS)


# --------------------------------------------------------------------------- names


def test_unknown_variable_lists_every_valid_name():
    with pytest.raises(ConfigError) as info:
        _C.validate_config({"RECCL_NICS": NICS, "RECCL_HEARTBEAT": "100"})
    message = str(info.value)
    assert "RECCL_HEARTBEAT" in message
    for name in NAMES:
        assert name in message, f"{name} missing from: {message}"


def test_unknown_variable_rejected_by_transport_and_from_process_env(monkeypatch):
    with pytest.raises(ConfigError, match="RECCL_NSOCK\\b"):
        Transport(reccl_env(RECCL_NSOCK="4"))
    monkeypatch.setenv("RECCL_TYPO_VAR", "1")
    with pytest.raises(ConfigError, match="RECCL_TYPO_VAR"):
        _C.validate_config()  # None: reads os.environ
    with pytest.raises(ConfigError, match="RECCL_TYPO_VAR"):
        torch_reccl.nics()


def test_non_reccl_variables_are_ignored():
    _C.validate_config({"NCCL_DEBUG": "INFO", "PATH": "/bin", "reccl_nics": "bogus",
                        "RECCLX": "1"})


# --------------------------------------------------------------------------- values

INT_VARS = {
    "RECCL_HEARTBEAT_MS": (10, 60000),
    "RECCL_NO_PATH_TIMEOUT_MS": (100, 3600000),
    "RECCL_PEER_GONE_TIMEOUT_MS": (100, 3600000),
    "RECCL_CONNECT_TIMEOUT_MS": (100, 120000),
    "RECCL_NSOCKS": (0, 16),
    "RECCL_IO_THREADS": (0, 64),
    "RECCL_CHUNK_BYTES": (4096, 67108864),
    "RECCL_CHANNELS": (0, 64),
    "RECCL_WINDOW": (1, 64),
    "RECCL_DCR_PERIOD_MS": (10, 60000),
    "RECCL_DCR_OFFSET": (0, 1000000),
    "RECCL_SMALL_BYTES": (0, 4194304),
    "RECCL_HALVING_BYTES_PER_RANK": (0, 1 << 30),
    "RECCL_IB_TIMEOUT": (1, 31),
    "RECCL_IB_RETRY_CNT": (0, 7),
    "RECCL_IB_TC": (0, 255),
    "RECCL_IB_SL": (0, 15),
    "RECCL_IB_GID_INDEX": (-1, 255),
    "RECCL_IB_FENCE_DELAY_MS": (0, 1000),
    "RECCL_IB_BUSY_POLL_US": (0, 10000),
    "RECCL_NVL_MAX_BYTES": (1048576, 1073741824),
    "RECCL_GREY_PCT": (1, 50),
    "RECCL_GREY_RECOVER_PCT": (50, 100),
    "RECCL_GREY_MS": (100, 600000),
    "RECCL_GREY_MIN_BYTES": (1, 1099511627776),
    "RECCL_GREY_RETRY_MS": (100, 3600000),
}


@pytest.mark.parametrize("name", sorted(INT_VARS))
def test_integer_ranges_are_enforced_and_named(name):
    lo, hi = INT_VARS[name]
    _C.validate_config({name: str(lo)})
    _C.validate_config({name: str(hi)})
    for bad in (str(lo - 1), str(hi + 1), "abc", "", "1.5", "12abc", "1e3", "0x10",
                "-" + str(hi), "99999999999999999999999"):
        with pytest.raises(ConfigError) as info:
            _C.validate_config({name: bad})
        message = str(info.value)
        assert name in message
        assert f"{lo}..{hi}" in message, f"range not named for {name}={bad!r}: {message}"


def test_integer_whitespace_is_rejected_consistently():
    with pytest.raises(ConfigError):
        _C.validate_config({"RECCL_HEARTBEAT_MS": "100 "})
    with pytest.raises(ConfigError):
        _C.validate_config({"RECCL_HEARTBEAT_MS": " 100"})


@pytest.mark.parametrize("name", ["RECCL_FAILBACK", "RECCL_BACKUP", "RECCL_GREY"])
def test_booleans(name):
    _C.validate_config({name: "0"})
    _C.validate_config({name: "1"})
    for bad in ("2", "true", "yes", "", "-1", "01"):
        with pytest.raises(ConfigError) as info:
            _C.validate_config({name: bad})
        assert name in str(info.value) and "0 or 1" in str(info.value)


def test_debug_levels():
    for level in ("NONE", "WARN", "INFO", "TRACE"):
        _C.validate_config({"RECCL_DEBUG": level})
    for bad in ("LOUD", "info", "", "DEBUG"):
        with pytest.raises(ConfigError) as info:
            _C.validate_config({"RECCL_DEBUG": bad})
        message = str(info.value)
        for level in ("NONE", "WARN", "INFO", "TRACE"):
            assert level in message


def test_algo_setting():
    for value in ("auto", "ring", "halving"):
        _C.validate_config({"RECCL_ALGO": value})
    for bad in ("rd", "Ring", "", "halving,ring", "rabenseifner"):
        with pytest.raises(ConfigError) as info:
            _C.validate_config({"RECCL_ALGO": bad})
        message = str(info.value)
        assert "RECCL_ALGO" in message
        for value in ("auto", "ring", "halving"):
            assert value in message


def test_transport_setting():
    for value in ("auto", "tcp", "ib"):
        _C.validate_config({"RECCL_TRANSPORT": value})
    for bad in ("IB", "rdma", "", "tcp,ib", " tcp"):
        with pytest.raises(ConfigError) as info:
            _C.validate_config({"RECCL_TRANSPORT": bad})
        assert "RECCL_TRANSPORT" in str(info.value) and "auto, tcp or ib" in str(info.value)


@pytest.mark.parametrize("value", [",127.0.0.1", "127.0.0.1,,127.0.0.2", ","])
def test_nics_with_an_empty_entry(value):
    with pytest.raises(ConfigError, match="empty"):
        _C.validate_config({"RECCL_NICS": value})
    with pytest.raises(ConfigError, match="empty"):
        Transport(reccl_env(RECCL_NICS=value))


def test_nics_with_a_trailing_empty_entry():
    """Regression: std::getline dropped a trailing empty entry ('127.0.0.1,')."""
    with pytest.raises(ConfigError):
        _C.validate_config({"RECCL_NICS": "127.0.0.1,"})


def test_nics_with_an_unknown_interface_names_the_available_ones():
    for call in (lambda: Transport(reccl_env(RECCL_NICS="127.0.0.1,nosuchnic0")),
                 lambda: torch_reccl.nics({"RECCL_NICS": "nosuchnic0"}),
                 lambda: torch_reccl.nics({"RECCL_NICS": "10.255.255.254"})):
        with pytest.raises(ConfigError) as info:
            call()
        message = str(info.value)
        assert "available" in message and "lo(127.0.0.1)" in message, message


def test_nics_listed_twice_and_too_many():
    with pytest.raises(ConfigError, match="twice"):
        torch_reccl.nics({"RECCL_NICS": "127.0.0.1,127.0.0.1"})
    thirteen = ",".join(f"127.0.3.{i}" for i in range(1, 14))
    with pytest.raises(ConfigError, match="at most 12"):
        Transport(reccl_env(RECCL_NICS=thirteen))


def test_valid_settings_are_accepted():
    env = {
        "RECCL_NICS": NICS, "RECCL_HEARTBEAT_MS": "250", "RECCL_NO_PATH_TIMEOUT_MS": "1000",
        "RECCL_CONNECT_TIMEOUT_MS": "500", "RECCL_NSOCKS": "2", "RECCL_CHUNK_BYTES": "65536",
        "RECCL_FAILBACK": "0", "RECCL_BACKUP": "1", "RECCL_DEBUG": "NONE",
    }
    _C.validate_config(env)
    t = Transport(env)
    assert [n["name"] for n in t.nics()] == [PRIMARY, BACKUP]
    listener = t.listen(1)
    decoded = _testing.decode_handle(listener.handle)
    assert decoded["chunk_bytes"] == 65536
    assert decoded["listener_nic"] == 1 and decoded["listener_backup"] == 0
    listener.close()


def test_backup_off_puts_no_backup_in_the_handle():
    t = Transport(reccl_env(RECCL_BACKUP="0"))
    listener = t.listen(0)
    assert _testing.decode_handle(listener.handle)["listener_backup"] == -1
    listener.close()


def test_listen_and_connect_check_the_nic_index():
    t = Transport(reccl_env())
    with pytest.raises(ConfigError, match="0..1"):
        t.listen(2)
    listener = t.listen(0)
    with pytest.raises(ConfigError, match="out of range"):
        t.connect(-1, listener.handle)
    listener.close()


# --------------------------------------------------------------------------- docs


def test_the_documented_table_is_the_generated_one():
    with open(DOC) as f:
        text = f.read()
    assert DOC_BEGIN in text and DOC_END in text, f"{DOC} lost its settings-table markers"
    documented = text.split(DOC_BEGIN, 1)[1].split(DOC_END, 1)[0].strip("\n") + "\n"
    assert documented == markdown(), (
        "docs/configuration.md's settings table differs from the code's; paste the output of "
        "`python -m torch_reccl.settings --markdown` between its markers")


def test_the_table_is_complete_and_every_default_valid():
    assert INT_VARS == {name: s["range"] for name, s in SETTINGS.items()
                        if s["range"] is not None and name != "RECCL_NIC_GPUS"}
    for name, s in SETTINGS.items():
        assert s["doc"] and s["valid"], name
        # a default is either a value (valid: Config() parses it) or a description
        assert (s["default"] is None) != (s["default_doc"] is None), name
        if s["default"] is not None:
            _C.validate_config({name: s["default"]})


def test_settings_cli(capsys):
    from torch_reccl import settings as module

    assert module.main([]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("RECCL_NICS=(") and len(lines) == len(SETTINGS)
    assert "RECCL_CHUNK_BYTES=1048576  [an integer in 4096..67108864]" in lines
    assert module.main(["--markdown"]) == 0
    assert capsys.readouterr().out == markdown()


# --------------------------------------------------------------------------- process-group options

OPTIONS = {"channels": "RECCL_CHANNELS", "chunk_bytes": "RECCL_CHUNK_BYTES", "window": "RECCL_WINDOW"}


def test_every_options_field_is_a_setting_and_back():
    fields = {f.name for f in dataclasses.fields(Options)}
    assert {s["option"]: name for name, s in SETTINGS.items() if s["option"]} == OPTIONS
    assert fields == set(OPTIONS)


@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_options_take_their_settings_range(option):
    lo, hi = INT_VARS[OPTIONS[option]]
    assert getattr(Options(**{option: lo}), option) == lo
    assert getattr(Options(**{option: hi}), option) == hi
    Options(**{option: None})
    for bad in (lo - 1, hi + 1, -(1 << 70), 1 << 70):
        with pytest.raises(ValueError) as info:
            Options(**{option: bad})
        assert str(info.value) == f"{option}={bad} is not valid: expected an integer in {lo}..{hi}"
    for bad in (True, 1.0, "4", [4]):
        with pytest.raises(ValueError) as info:
            Options(**{option: bad})
        assert f"{option}={bad!r} is not valid" in str(info.value) and OPTIONS[option] in str(info.value)


def test_chunk_bytes_has_one_range_everywhere():
    """The option overrides RECCL_CHUNK_BYTES, whose bound is the wire's (a frame
    carries at most one 64 MiB chunk): the option cannot go past it."""
    assert INT_VARS["RECCL_CHUNK_BYTES"] == (4096, 64 << 20)
    Options(chunk_bytes=64 << 20)
    with pytest.raises(ValueError, match="4096..67108864"):
        Options(chunk_bytes=256 << 20)


def test_unknown_option_names_the_options():
    with pytest.raises(ConfigError) as info:
        _C.check_option("chunks", "4096")
    message = str(info.value)
    assert "chunks" in message and all(option in message for option in OPTIONS)


# --------------------------------------------------------------------------- backups

RC0 = "/sys/devices/pci0000:00"
RC1 = "/sys/devices/pci0000:80"


def under_switch(rc, root_port, switch_bus, port, device_bus):
    """A device behind a PCIe switch: root port / switch upstream / downstream / device."""
    return (f"{rc}/0000:{rc[-2:]}:{root_port}/0000:{switch_bus}:00.0/"
            f"0000:{switch_bus + 1}:{port:02x}.0/0000:{device_bus}:00.0")


S1A = (under_switch(RC0, "01.0", 10, 0, 20), 0)
S1B = (under_switch(RC0, "01.0", 10, 1, 21), 0)
S2A = (under_switch(RC0, "02.0", 30, 0, 40), 0)
S2B = (under_switch(RC0, "02.0", 30, 1, 41), 0)


def backups(*nics):
    return _testing.choose_backups([(f"nic{i}", path, numa) for i, (path, numa) in enumerate(nics)])


def test_same_switch_costs_1_and_switch_siblings_back_each_other_up():
    assert backups(S1A, S1B, S2A, S2B) == [(1, 1), (0, 1), (3, 1), (2, 1)]
    # interleaved rail order: the sibling still wins over the next NIC in order
    assert backups(S1A, S2A, S1B, S2B) == [(2, 1), (3, 1), (0, 1), (1, 1)]


def test_across_root_complex_costs_100_and_across_numa_adds_200():
    direct0 = (f"{RC0}/0000:00:01.0/0000:05:00.0", 0)
    direct1 = (f"{RC0}/0000:00:02.0/0000:06:00.0", 0)
    remote = (f"{RC1}/0000:80:01.0/0000:81:00.0", 1)
    result = backups(direct0, direct1, remote)
    assert result[0] == (1, 100) and result[1] == (0, 100)
    assert result[2][1] == 300  # root complex + NUMA
    assert result[2][0] in (0, 1)
    # the near NIC wins over a nearer-in-rail-order NIC across NUMA
    assert backups(S1A, remote, S1B)[0] == (2, 1)
    assert backups(remote, direct0)[0] == (1, 300)
    # same NUMA node, other root complex: root complex cost only
    other_rc_same_numa = (f"{RC1}/0000:80:01.0/0000:81:00.0", 0)
    assert backups(direct0, other_rc_same_numa) == [(1, 100), (0, 100)]


def test_ties_are_spread_evenly():
    three = [(under_switch(RC0, "01.0", 10, p, 20 + p), 0) for p in range(3)]
    result = backups(*three)
    assert all(cost == 1 for _b, cost in result)
    assert sorted(b for b, _c in result) == [0, 1, 2], result  # each NIC backs up exactly one
    four_ports = [(f"{RC0}/0000:00:0{p}.0/0000:0{p}:00.0", 0) for p in range(1, 5)]
    result = backups(*four_ports)
    assert all(cost == 100 for _b, cost in result)
    assert sorted(b for b, _c in result) == [0, 1, 2, 3], result
    assert all(b != i for i, (b, _c) in enumerate(result))


def test_without_pci_path_the_backup_is_the_next_nic():
    assert backups(("", -1), ("", -1), ("", -1)) == [(1, -1), (2, -1), (0, -1)]
    # a NIC with a PCI path prefers a measured neighbour over an unknown one
    result = backups(S1A, ("", -1), S1B)
    assert result[0] == (2, 1) and result[2] == (0, 1)
    assert result[1][1] == -1 and result[1][0] in (0, 2)
    assert backups(S1A) == [(-1, -1)]
    assert backups() == []


# --------------------------------------------------------------------------- nics / topo


def test_nics_with_loopback_addresses():
    rows = torch_reccl.nics({"RECCL_NICS": "127.0.0.1,127.0.0.2,127.0.0.3"})
    assert [r["name"] for r in rows] == [PRIMARY, BACKUP, "lo:127.0.0.3"]
    assert [r["address"] for r in rows] == ["127.0.0.1", "127.0.0.2", "127.0.0.3"]
    assert [r["index"] for r in rows] == [0, 1, 2]
    assert [r["backup_index"] for r in rows] == [1, 2, 0]
    assert [r["backup"] for r in rows] == [BACKUP, "lo:127.0.0.3", PRIMARY]
    for r in rows:
        assert r["interface"] == "lo" and r["pci_path"] == "" and r["backup_cost"] == -1
        assert r["up"] is True


def test_nics_shows_injected_health():
    Transport(reccl_env())  # registers the NICs with the health table
    torch_reccl.inject_fault(PRIMARY, "down")
    rows = {r["name"]: r for r in torch_reccl.nics({"RECCL_NICS": NICS})}
    assert rows[PRIMARY]["up"] is False and rows[BACKUP]["up"] is True
    assert torch_reccl.stats()["nics"][PRIMARY]["up"] is False
    torch_reccl.inject_fault(PRIMARY, "up")
    rows = {r["name"]: r for r in torch_reccl.nics({"RECCL_NICS": NICS})}
    assert rows[PRIMARY]["up"] is True


def test_inject_fault_rejects_unknown_nics_and_kinds():
    Transport(reccl_env())
    with pytest.raises(ConfigError, match="known NICs"):
        torch_reccl.inject_fault("lo:10.9.9.9", "down")
    with pytest.raises(ValueError, match="valid kinds"):
        torch_reccl.inject_fault(PRIMARY, "melt")
    with pytest.raises(ValueError):
        torch_reccl.inject_fault(PRIMARY, "flap", period=0)


def test_topo_cli_table(monkeypatch, capsys):
    monkeypatch.setenv("RECCL_NICS", "127.0.0.1,127.0.0.2,127.0.0.3")
    assert cli.main(["topo"]) == 0
    nic_table, gpu_part = capsys.readouterr().out.strip().split("\n\n", 1)
    lines = nic_table.splitlines()
    # the GPU part (tests/tools/test_gpu_topo.py) says where its answers came from
    assert gpu_part.startswith("topology source: ")
    assert lines[0].split()[:7] == ["#", "NIC", "address", "up", "health", "backup", "cost"]
    assert len(lines) == 4
    row = lines[1].split()
    assert row[:7] == ["0", PRIMARY, "127.0.0.1", "yes", "ok", BACKUP, "next-in-order"]
    assert lines[3].split()[:6] == ["2", "lo:127.0.0.3", "127.0.0.3", "yes", "ok", PRIMARY]


def test_topo_table_shows_grey_failures():
    from torch_reccl.cli.topo import format_table

    rows = torch_reccl.nics({"RECCL_NICS": "127.0.0.1,127.0.0.2,127.0.0.3"})
    assert {r["grey"] for r in rows} == {"healthy"}
    rows[1]["grey"], rows[2]["grey"] = "degraded", "probation"
    lines = format_table(rows).splitlines()
    assert [line.split()[4] for line in lines[1:]] == ["ok", "DEGRADED", "trial"]


def test_topo_cli_json(monkeypatch, capsys):
    monkeypatch.setenv("RECCL_NICS", NICS)
    assert cli.main(["topo", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["nics"] == torch_reccl.nics({"RECCL_NICS": NICS})
    assert report["gpu_topology"]["source"] in ("nvml", "sysfs")


def test_topo_cli_with_a_bad_setting_names_the_choices(monkeypatch, capsys):
    monkeypatch.setenv("RECCL_NICS", "nosuchnic0")
    try:
        rc = cli.main(["topo"])
    except ConfigError as error:
        message = str(error)
    else:
        assert rc != 0
        message = capsys.readouterr().err
    assert "nosuchnic0" in message and "available" in message
