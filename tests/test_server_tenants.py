"""API key file parsing, tenant salts and auth decisions (no model, no server)."""

from __future__ import annotations

import json

import pytest

from hotprefix.config.sections import ConfigError
from hotprefix.server.tenants import AuthError, TenantRegistry, parse_keys, tenant_salt, tenant_tag


def test_string_and_object_entries():
    keys = parse_keys({"k1": "alice", "k2": {"tenant": "bob", "shared_prefix_tokens": 64,
                                             "cache": "none", "priority": 3, "ttl_s": 5, "admin": True}})
    assert keys["k1"].name == "alice" and keys["k1"].cache_write and not keys["k1"].admin
    b = keys["k2"]
    assert (b.name, b.shared_prefix_tokens, b.cache_write, b.priority, b.ttl_s, b.admin) == \
        ("bob", 64, False, 3, 5.0, True)


@pytest.mark.parametrize("raw", [
    [], {}, "alice", {"k": 3}, {"k": ""}, {"k": {"name": "x"}}, {"k": {"tenant": "x", "salt": "s"}},
    {"k": {"tenant": "x", "shared_prefix_tokens": -1}}, {"k": {"tenant": "x", "cache": "always"}},
    {"k": {"tenant": "x", "admin": "yes"}}, {"k": {"tenant": "x", "ttl_s": -2}},
    {"k": {"tenant": "x", "priority": 1.5}}, {"": "x"},
])
def test_invalid_key_files_are_refused(raw):
    with pytest.raises(ConfigError):
        parse_keys(raw)


def test_the_admin_keys_tenant_name_is_reserved(tmp_path):
    """A key file tenant named as the --admin-key's requests would share their salt, hence read
    the prompts the admin cached: refused at start, with the reason."""
    for entry in ("__admin__", {"tenant": "__admin__", "admin": True}):
        with pytest.raises(ConfigError, match="reserved for the --admin-key"):
            parse_keys({"sk-x": entry})
    f = tmp_path / "keys.json"
    f.write_text(json.dumps({"a1": "alice", "a2": "admin"}))
    reg = TenantRegistry.from_file(str(f), admin_key="root")
    names = {reg.authenticate(k).salt for k in ("a1", "a2", "root")}
    assert len(names) == 3  # the admin key's tenant shares no salt with a key file's


def test_unreadable_file(tmp_path):
    bad = tmp_path / "keys.json"
    bad.write_text("{nope")
    with pytest.raises(ConfigError):
        TenantRegistry.from_file(str(bad))
    with pytest.raises(ConfigError):
        TenantRegistry.from_file(str(tmp_path / "missing.json"))


def test_salts_are_per_tenant_and_stable():
    assert tenant_salt("alice") == tenant_salt("alice") != tenant_salt("bob")
    assert "alice" not in tenant_salt("alice") and "alice" not in tenant_tag("alice")
    assert tenant_tag(None) == "-"


def test_auth_with_key_file(tmp_path):
    f = tmp_path / "keys.json"
    f.write_text(json.dumps({"a1": "alice", "a2": "alice", "ops": {"tenant": "ops", "admin": True}}))
    reg = TenantRegistry.from_file(str(f), shared_prefix_tokens=32)
    a1, a2 = reg.authenticate("a1"), reg.authenticate("a2")
    assert a1.salt == a2.salt is not None and a1.shared_prefix_tokens == 32
    for key in (None, "", "A1", "a1 "):
        with pytest.raises(AuthError) as e:
            reg.authenticate(key)
        assert e.value.status == 401
    with pytest.raises(AuthError) as e:
        reg.require_admin(a1)
    assert e.value.status == 403
    reg.require_admin(reg.authenticate("ops"))


def test_single_tenant_without_key_file():
    reg = TenantRegistry.from_file(None)
    t = reg.authenticate(None)
    assert t.name is None and t.salt is None and t.admin
    locked = TenantRegistry.from_file(None, admin_key="root")
    assert not locked.authenticate(None).admin and locked.authenticate("root").admin
