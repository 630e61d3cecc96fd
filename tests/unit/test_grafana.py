"""The Grafana dashboard (appliance/grafana/hpclb-dashboard.json) against the
exporter that feeds it: every metric and label a query names is one the
exporter serves for a full status snapshot, every query is PromQL that
Prometheus parses, and a real Prometheus scraping a real exporter answers
every panel with data. promtool lints the exporter's output."""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from hpclb.faces import metrics

from .test_metrics import FULL_STATUS, STATUS, exposition

DASHBOARD = Path(__file__).resolve().parents[2] / "appliance" / "grafana" / "hpclb-dashboard.json"

# PromQL's vocabulary: names that are not metrics.
FUNCTIONS = frozenset("""
abs absent absent_over_time acos acosh asin asinh atan atanh avg_over_time ceil changes clamp
clamp_max clamp_min cos cosh count_over_time day_of_month day_of_week day_of_year days_in_month
deg delta deriv exp floor histogram_avg histogram_count histogram_fraction histogram_quantile
histogram_stddev histogram_stdvar histogram_sum holt_winters hour idelta increase irate
label_join label_replace last_over_time ln log10 log2 mad_over_time max_over_time min_over_time
minute month pi predict_linear present_over_time quantile_over_time rad rate resets round scalar
sgn sin sinh sort sort_by_label sort_by_label_desc sort_desc sqrt stddev_over_time
stdvar_over_time sum_over_time tan tanh time timestamp vector year
""".split())
AGGREGATIONS = frozenset("""
sum min max avg group stddev stdvar count count_values bottomk topk quantile limitk limit_ratio
""".split())
LABEL_LISTS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right"})
KEYWORDS = frozenset({"bool", "and", "or", "unless", "offset", "atan2", "inf", "nan"})
# Labels Prometheus adds to every scraped series.
TARGET_LABELS = frozenset({"job", "instance"})
GRAFANA_BUILTINS = frozenset({"__rate_interval", "__interval", "__range", "__interval_ms"})

_STRING = r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'|`[^`]*`'
TOKEN = re.compile(rf"""
    (?P<string>{_STRING})
  | (?P<matchers>\{{(?:{_STRING}|[^}}"'`])*\}})
  | (?P<range>\[[^\]]*\])
  | (?P<variable>\$\{{?\w+(?::\w+)?\}}?)
  | (?P<duration>(?:\d+(?:ms|[smhdwy]))+)
  | (?P<number>(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?)
  | (?P<ident>[A-Za-z_:][\w:]*)
  | (?P<space>\s+)
  | (?P<punct>[(),+\-*/%^=!<>~@])
""", re.X)
MATCHER = re.compile(rf"([A-Za-z_]\w*)\s*(?:=~|!~|!=|=)\s*(?:{_STRING})")
VARIABLE = re.compile(r"\$\{?(\w+)")


@dataclass
class References:
    """What one query asks of the exporter."""
    metrics: set[str] = field(default_factory=set)
    labels: dict[str, set[str]] = field(default_factory=dict)  # metric -> matcher labels
    grouping: set[str] = field(default_factory=set)  # by/on/without/... labels
    problems: list[str] = field(default_factory=list)


def tokens(expr: str) -> list[tuple[str, str]]:
    out, at = [], 0
    for m in TOKEN.finditer(expr):
        if m.start() != at:
            raise ValueError(f"cannot read {expr[at:m.start()]!r} in {expr!r}")
        at = m.end()
        if m.lastgroup != "space":
            out.append((str(m.lastgroup), m.group()))
    if at != len(expr):
        raise ValueError(f"cannot read {expr[at:]!r} in {expr!r}")
    return out


def promql_references(expr: str) -> References:
    refs = References()
    try:
        toks = tokens(expr)
    except ValueError as err:
        refs.problems.append(str(err))
        return refs
    i = 0
    while i < len(toks):
        kind, text = toks[i]
        after = toks[i + 1] if i + 1 < len(toks) else ("", "")
        if kind == "ident" and text in LABEL_LISTS:
            if after[1] == "(":  # a label list: (a, b) — names of labels, not metrics
                close = next(j for j in range(i + 2, len(toks)) if toks[j][1] == ")")
                refs.grouping.update(t for k, t in toks[i + 2:close] if k == "ident")
                i = close
        elif kind == "ident" and text not in KEYWORDS | AGGREGATIONS:
            if after[1] == "(":
                if text not in FUNCTIONS:
                    refs.problems.append(f"unknown function {text}() in {expr!r}")
            else:
                refs.metrics.add(text)
                labels = refs.labels.setdefault(text, set())
                if after[0] == "matchers":
                    labels.update(MATCHER.findall(after[1]))
        elif kind == "matchers" and (i == 0 or toks[i - 1][0] != "ident"):
            refs.problems.append(f"a selector without a metric name in {expr!r}")
        i += 1
    return refs


def template_references(query: str) -> References:
    """A Grafana variable's query: label_values(selector, label), or PromQL."""
    m = re.fullmatch(r"\s*label_values\((.*),\s*([A-Za-z_]\w*)\s*\)\s*", query, re.S)
    if m:
        refs = promql_references(m.group(1))
        for labels in refs.labels.values():
            labels.add(m.group(2))
        return refs
    m = re.fullmatch(r"\s*query_result\((.*)\)\s*", query, re.S)
    return promql_references(m.group(1) if m else query)


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dashboard.get("panels", []):
        yield panel
        yield from panel.get("panels", [])  # a collapsed row keeps its panels inside


def queries(dashboard: dict[str, Any]) -> Iterator[tuple[str, str, bool]]:
    """(where, query, is_template) for every panel target and query variable."""
    for panel in panels(dashboard):
        for target in panel.get("targets", []):
            yield f"panel {panel.get('title')!r} {target.get('refId')}", target["expr"], False
    for var in dashboard.get("templating", {}).get("list", []):
        if var.get("type") == "query":
            q = var["query"]
            yield f"variable {var['name']}", q["query"] if isinstance(q, dict) else q, True


def served(text: str) -> dict[str, set[str]]:
    """Sample name -> its label names, as Prometheus would store them (counters'
    samples carry _total; a family without samples gives Prometheus nothing)."""
    out: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, set()).update(sample.labels)
    return out


def check(dashboard: dict[str, Any], exporter: dict[str, set[str]]) -> list[str]:
    """Every problem of the dashboard against what the exporter serves."""
    variables = {v["name"] for v in dashboard.get("templating", {}).get("list", [])}
    problems = []
    for where, query, is_template in queries(dashboard):
        refs = template_references(query) if is_template else promql_references(query)
        problems += [f"{where}: {p}" for p in refs.problems]
        if not refs.metrics:
            problems.append(f"{where}: names no metric: {query!r}")
        for name in sorted(refs.metrics - exporter.keys()):
            problems.append(f"{where}: {name} is not a metric the exporter serves")
        known = set(TARGET_LABELS)
        for name, labels in refs.labels.items():
            have = exporter.get(name, set()) | TARGET_LABELS
            known |= have
            problems += [f"{where}: {name} has no label {label}"
                         for label in sorted(labels - have) if name in exporter]
        problems += [f"{where}: no metric of the query has a label {label}"
                     for label in sorted(refs.grouping - known)]
        problems += [f"{where}: unknown variable ${v}"
                     for v in VARIABLE.findall(query) if v not in variables | GRAFANA_BUILTINS]
    return problems


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


@pytest.fixture(scope="module")
def exporter_text() -> str:
    return exposition(FULL_STATUS)


def tool(name: str) -> str:
    """A Debian prometheus package's binary: CI must have it (bootstrap installs
    it); elsewhere its absence skips, saying why."""
    path = shutil.which(name)
    if path is None:
        reason = f"{name} not installed (Debian package prometheus)"
        if os.environ.get("CI"):
            pytest.fail(reason)
        print(f"SKIP: {reason}")
        pytest.skip(reason)
    return path


def test_the_tokenizer_finds_metrics_not_promql_words() -> None:
    refs = promql_references(
        'sum by (pool, backend) (rate(hpclb_backend_packets_total{pool=~"$pool", backend!="x}"}'
        '[5m])) / on (pool) group_left sum by (pool) (rate(hpclb_backend_packets_total[1h30m]'
        ' offset 5m)) > bool 0.5 and ignoring(job) 2 * max(hpclb_vip_bytes_total)')
    assert refs.metrics == {"hpclb_backend_packets_total", "hpclb_vip_bytes_total"}
    assert refs.labels["hpclb_backend_packets_total"] == {"pool", "backend"}
    assert refs.grouping == {"pool", "backend", "job"}
    assert refs.problems == []
    assert promql_references("frobnicate(hpclb_x)").problems  # not a PromQL function
    refs = template_references('label_values(hpclb_backend_weight{pool=~"$pool"}, backend)')
    assert refs.metrics == {"hpclb_backend_weight"}
    assert refs.labels["hpclb_backend_weight"] == {"pool", "backend"}


def test_the_dashboard_asks_only_for_what_the_exporter_serves(
        dashboard: dict[str, Any], exporter_text: str) -> None:
    exporter = served(exporter_text)
    assert check(dashboard, exporter) == []
    named = set().union(*(promql_references(q).metrics for _, q, t in queries(dashboard) if not t))
    # the panels the dashboard exists for
    assert {"hpclb_vip_packets_total", "hpclb_backend_packets_total",
            "hpclb_dataplane_drops_total", "hpclb_backend_weight",
            "hpclb_backend_configured_weight", "hpclb_backend_pinned_weight",
            "hpclb_backend_input_cpu_load_ratio", "hpclb_backend_input_memory_used_ratio",
            "hpclb_backend_input_gpu_memory_used_ratio", "hpclb_backend_input_rtt_seconds",
            "hpclb_backend_input_score", "hpclb_backend_up", "hpclb_backend_state",
            "hpclb_table_pushes_total", "hpclb_table_push_last_duration_seconds",
            "hpclb_resident_memory_bytes", "hpclb_conn_table_entries",
            "hpclb_conn_table_capacity"} <= named


def test_the_check_fails_a_dashboard_naming_what_is_not_served(
        dashboard: dict[str, Any], exporter_text: str) -> None:
    exporter = served(exporter_text)
    doctored = copy.deepcopy(dashboard)
    panel = next(p for p in panels(doctored) if p.get("targets"))
    target = panel["targets"][0]
    target["expr"] = 'sum(rate(hpclb_no_such_packets_total{pool=~"$pool"}[5m]))'
    assert check(doctored, exporter) == [f"panel {panel['title']!r} A: "
                                         "hpclb_no_such_packets_total is not a metric the "
                                         "exporter serves"]
    target["expr"] = 'hpclb_backend_up{pool=~"$pool"}'  # served, but has no pool label
    assert check(doctored, exporter) == [f"panel {panel['title']!r} A: "
                                         "hpclb_backend_up has no label pool"]
    target["expr"] = 'sum by (vip) (hpclb_backend_up{backend=~"$backends"})'
    assert {p.split(": ", 1)[1] for p in check(doctored, exporter)} == {
        "no metric of the query has a label vip", "unknown variable $backends"}


def test_the_dashboard_is_importable(dashboard: dict[str, Any]) -> None:
    """Shape Grafana's import needs: a Prometheus datasource variable every
    panel and query uses, the pool/backend/vip variables, unique panel ids,
    and panels that do not overlap."""
    assert dashboard["schemaVersion"] >= 36 and dashboard["uid"] and dashboard["title"]
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"
    assert variables["DS_PROMETHEUS"]["query"] == "prometheus"
    assert {"pool", "backend", "vip"} <= variables.keys()
    everything = [*panels(dashboard), *variables.values()]
    for item in everything:
        if item.get("type") not in ("row", "datasource"):
            assert item["datasource"] == {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
    for panel in panels(dashboard):
        for target in panel.get("targets", []):
            assert target["datasource"]["uid"] == "${DS_PROMETHEUS}"
    ids = [p["id"] for p in panels(dashboard)]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for p in panels(dashboard):
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"])
                for y in range(g["y"], g["y"] + g["h"])}
        assert not mine & cells, f"panel {p['title']!r} overlaps another"
        cells |= mine


def substituted(query: str) -> str:
    """A dashboard query as Grafana sends it, with every variable at All."""
    query = re.sub(r"\$\{?__\w+\}?", "1m", query)
    return re.sub(r"\$\{?\w+\}?", ".*", query)


def promql_of(query: str, is_template: bool) -> str:
    m = re.fullmatch(r"\s*label_values\((.*),\s*\w+\s*\)\s*", query, re.S)
    return substituted(m.group(1) if is_template and m else query)


def test_every_query_is_promql_prometheus_parses(
        dashboard: dict[str, Any], tmp_path: Path) -> None:
    promtool = tool("promtool")
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"hpclb_dashboard:query_{i}", "expr": promql_of(q, t)}
        for i, (_, q, t) in enumerate(queries(dashboard))]}]}
    path = tmp_path / "dashboard.rules.yml"
    path.write_text(json.dumps(rules, indent=1))  # JSON is YAML
    run = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"{len(rules['groups'][0]['rules'])} rules found" in run.stdout


@pytest.mark.parametrize("status", [FULL_STATUS, STATUS], ids=["full", "older"])
def test_promtool_finds_no_lint_problem(status: dict[str, Any]) -> None:
    promtool = tool("promtool")
    run = subprocess.run([promtool, "check", "metrics"], input=exposition(status),
                         capture_output=True, text=True, timeout=60)
    assert (run.returncode, run.stdout + run.stderr) == (0, "")


def test_promtool_sees_a_lint_problem() -> None:
    """The lint test above could pass by promtool reading nothing: it does read."""
    promtool = tool("promtool")
    run = subprocess.run([promtool, "check", "metrics"],
                         input="# HELP x_ms x\n# TYPE x_ms gauge\nx_ms 1\n",
                         capture_output=True, text=True, timeout=60)
    assert run.returncode != 0 and "x_ms" in run.stdout + run.stderr


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real Prometheus scraping (every 250 ms) a real exporter serving FULL_STATUS;
    yields its API's base URL once it holds three scrapes."""
    binary = tool("prometheus")
    work = tmp_path_factory.mktemp("prometheus")
    exporter_port, api_port = free_port(), free_port()
    (work / "prometheus.yml").write_text(json.dumps({
        "global": {"scrape_interval": "250ms", "evaluation_interval": "1s"},
        "scrape_configs": [{"job_name": "hpclb",
                            "static_configs": [{"targets": [f"127.0.0.1:{exporter_port}"]}]}]}))
    exporter = metrics.Exporter("127.0.0.1", exporter_port, lambda: FULL_STATUS)
    with (work / "log").open("w") as log:
        server = subprocess.Popen(
            [binary, f"--config.file={work / 'prometheus.yml'}",
             f"--storage.tsdb.path={work / 'db'}",
             f"--web.listen-address=127.0.0.1:{api_port}", "--log.level=warn"],
            stdout=subprocess.DEVNULL, stderr=log)
    base = f"http://127.0.0.1:{api_port}/api/v1"
    try:
        query = urllib.parse.quote('count_over_time(up{job="hpclb"}[1m])')
        deadline = time.monotonic() + 60
        while True:
            assert server.poll() is None, (work / "log").read_text()
            assert time.monotonic() < deadline, "Prometheus never held three scrapes"
            try:
                result = get_json(f"{base}/query?query={query}")["data"]["result"]
                if result and float(result[0]["value"][1]) >= 3:
                    break
            except OSError:
                pass  # not listening yet
            time.sleep(0.5)
        yield base
    finally:
        server.terminate()
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        exporter.close()


def test_a_real_prometheus_answers_every_query(
        dashboard: dict[str, Any], prometheus: str) -> None:
    """Every panel target and variable, as Grafana would send it with every
    variable at All, returns series: names, labels and joins all match."""
    empty = []
    for where, query, is_template in queries(dashboard):
        expr = promql_of(query, is_template)
        answer = get_json(f"{prometheus}/query?query={urllib.parse.quote(expr)}")
        assert answer["status"] == "success", (where, answer)
        if not answer["data"]["result"]:
            empty.append(f"{where}: {expr}")
        elif is_template:
            label = re.fullmatch(r".*,\s*(\w+)\s*\)\s*", query, re.S)
            assert label and all(label.group(1) in r["metric"] for r in answer["data"]["result"])
    assert empty == []
