"""The S3 server the suite and `bench wan --links real` run (diloco/bench/_s3_server.py) indexes its key names
for listings; its answers must be moto's own. Checked against moto's unmodified server (its threaded werkzeug
server, in this process): the same puts, overwrites and deletes to both over HTTP, then every listing — v1 and
v2, with and without a delimiter, from a StartAfter, a marker or a continuation token, truncated or not — for
every prefix of every key and prefixes that match nothing, compared answer for answer, also after keys are
added and removed once the index exists.

Run: .venv/bin/pytest tests/integration/test_s3_listing_index.py -q   (about 20 seconds)
"""

from __future__ import annotations

import random

import pytest
from moto.server import ThreadedMotoServer

from diloco.bench._s3_server import moto_server, s3_client


@pytest.fixture(scope="module")
def servers():
    reference = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    reference.start()
    host, port = reference.get_host_and_port()
    try:
        with moto_server("127.0.0.1") as (endpoint, _):
            clients = [s3_client(f"http://{host}:{port}"), s3_client(endpoint)]
            for c in clients:
                c.create_bucket(Bucket="listing")
            yield clients
    finally:
        reference.stop()


def _keys(rng: random.Random) -> list[str]:
    keys = [f"run/fragments/{p:04d}/deltas/{name}/{seq:012d}" for p in range(3)
            for name in ("l0", "l1", "l10") for seq in range(rng.randint(0, 5))]
    keys += [f"run/versions/{v:020d}.json" for v in range(6)]
    keys += [f"run2/versions/{v:020d}.json" for v in range(2)]
    keys += ["a", "a/", "a/b", "a/b/c", "a-b", "ab", "a~", "é/x", "z", "run/heads-0000.json"]
    return keys


def _answers(client, prefix: str, delimiter: str | None, after: str | None, max_keys: int) -> list:
    args = {"Bucket": "listing", "Prefix": prefix, "MaxKeys": max_keys}
    if delimiter:
        args["Delimiter"] = delimiter
    v2 = client.list_objects_v2(**args, **({"StartAfter": after} if after else {}))
    pages = [v2, client.list_objects(**args, **({"Marker": after} if after else {}))]
    if v2.get("NextContinuationToken"):  # the next page, from the continuation token
        pages.append(client.list_objects_v2(**args, ContinuationToken=v2["NextContinuationToken"]))
    return [[(o["Key"], o["Size"], o["ETag"]) for o in r.get("Contents", [])]
            + [p["Prefix"] for p in r.get("CommonPrefixes", [])] + [r["IsTruncated"]] for r in pages]


def _compare(clients, keys: list[str], rng: random.Random) -> int:
    prefixes = {""} | {k[:i] for k in keys for i in range(1, len(k) + 1) if i == len(k) or k[i - 1] in "/-_"}
    prefixes |= {"nothing/", "run/fragments/9", "a/b/c/d", "é"}
    compared = 0
    for prefix in sorted(prefixes):
        after = rng.choice([None, rng.choice(keys), prefix + "0"])
        for delimiter in (None, "/"):
            for max_keys in (1000, 2):
                ref, ours = (_answers(c, prefix, delimiter, after, max_keys) for c in clients)
                assert ours == ref, (prefix, delimiter, after, max_keys)
                compared += 1
    return compared


def test_the_indexed_listing_answers_as_moto_does(servers) -> None:
    rng = random.Random(7)
    keys = _keys(rng)
    for key in keys:
        body = key.encode() * rng.randint(1, 3)
        for c in servers:
            c.put_object(Bucket="listing", Key=key, Body=body)
    assert _compare(servers, keys, rng) > 200  # the index is built by these listings
    # once it exists: overwrites, new keys, single and batch deletes keep it in step
    gone = rng.sample(keys, 12)
    added = [f"run/fragments/0001/deltas/l1/{seq:012d}" for seq in range(40, 45)] + ["a/b/cc", "0"]
    for c in servers:
        c.put_object(Bucket="listing", Key=keys[0], Body=b"overwritten")
        for key in added:
            c.put_object(Bucket="listing", Key=key, Body=key.encode())
        for key in gone[:6]:
            c.delete_object(Bucket="listing", Key=key)
        c.delete_objects(Bucket="listing", Delete={"Objects": [{"Key": k} for k in gone[6:]]})
    live = sorted(set(keys + added) - set(gone))
    assert _compare(servers, live, rng) > 200
    listed = servers[1].list_objects_v2(Bucket="listing", MaxKeys=1000)
    assert [o["Key"] for o in listed["Contents"]] == live
