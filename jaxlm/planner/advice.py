"""The planner's rows in plain words: the recommended row, the ranking of one device count's layouts, why the
winner wins, and what to do when one device cannot hold the run."""

from __future__ import annotations

from typing import Any, Sequence

from jaxlm.planner.hardware import Hardware


def _cost_key(row: dict[str, Any]) -> tuple:
  """Priced hardware: on-demand dollars; owned hardware (no price): wall hours; ties: fewer devices."""
  price = row["on_demand_usd"]
  return (row["on_demand_hours"] if price is None else price, row["devices"], row["step_time_sec"])


def recommend(rows: Sequence[dict[str, Any]], hardware: str, devices: int | None = None) -> dict[str, Any] | None:
  """The cheapest fitting row of one hardware profile on on-demand devices (owned hardware: the fastest; ties:
  fewer devices), optionally of one device count, or None."""
  fitting = [r for r in rows if r["hardware"] == hardware and r["fits"] and devices in (None, r["devices"])]
  return min(fitting, key=_cost_key) if fitting else None


def ranked(rows: Sequence[dict[str, Any]], hardware: str, devices: int) -> list[dict[str, Any]]:
  """The rows of one profile and device count, fitting ones first, fastest first."""
  chosen = [r for r in rows if r["hardware"] == hardware and r["devices"] == devices]
  return sorted(chosen, key=lambda r: (not r["fits"], r["step_time_sec"]))


def explain(rows: Sequence[dict[str, Any]], hardware: Hardware, devices: int) -> str:
  """Plain words for which layout wins on `devices` x `hardware`, and why the best of each other kind loses."""
  order = ranked(rows, hardware.name, devices)
  if not order:
    return f"{devices} x {hardware.name}: no layout can run this config"
  best = order[0]
  if not best["fits"]:
    least = min(order, key=lambda r: r["predicted_memory_gib"])
    return (f"{devices} x {hardware.name}: nothing fits; the smallest need is {least['predicted_memory_gib']:.1f} GiB "
            f"per device ({least['layout']} {least['mesh']}" + (", kernels.remat=full" if least["remat_fallback"]
                                                               else "") +
            f"), {least['usable_memory_gib']:.1f} GiB usable")
  link = f"{hardware.interconnect_bytes_per_sec / 1e9:.0f} GB/s"
  text = (f"{devices} x {hardware.name} ({best['compute_dtype']}): {best['layout']} wins (mesh data x fsdp x tensor x "
          f"pipeline = {best['mesh']}, train.grad_accum={best['grad_accum']}"
          + (f", mesh.pipeline_schedule={best['schedule']}" if best["pipeline"] > 1 else "")
          + (", kernels.remat=full: nothing fits without it" if best["remat_fallback"] else "")
          + f"): {best['step_time_sec']:.3f} s/step ({_parts(best, link)}), {100 * best['mfu']:.0f}% MFU, "
          f"{best['predicted_memory_gib']:.1f} of {best['usable_memory_gib']:.1f} GiB")
  kind_of = lambda r: ("pipeline" if r["pipeline"] > 1 else "tensor" if r["tensor"] > 1 else "fsdp" if r["fsdp"] > 1
                       else "data")
  kinds: dict[str, dict[str, Any]] = {kind_of(best): best}  # the best row of each other kind of parallelism
  for r in order[1:]:
    if r["fits"]:
      kinds.setdefault(kind_of(r), r)
  for r in sorted(order, key=lambda r: r["predicted_memory_gib"]):  # of a kind where nothing fits: the smallest
    kinds.setdefault(kind_of(r), r)
  reasons = []
  for kind, r in list(kinds.items())[1:]:
    if not r["fits"]:
      remat = ", even with kernels.remat=full" if r["remat_fallback"] else ""
      reasons.append(f"{r['layout']} does not fit ({r['predicted_memory_gib']:.1f} GiB{remat})")
      continue
    slower = r["step_time_sec"] / best["step_time_sec"]
    why = _parts(r, link)
    if kind == "pipeline":
      why += (f"; a {100 * r['bubble_fraction']:.0f}% bubble at {r['grad_accum']} micro-batches, and every tick waits "
              "for the last stage (its blocks plus the head, the forward recomputed in the backward)")
    reasons.append(f"{r['layout']} {slower:.2f}x slower ({why})")
  return text + (". " + "; ".join(reasons) if reasons else "")


def _parts(row: dict[str, Any], link: str) -> str:
  return (f"compute {row['compute_sec']:.3f} s, memory {row['memory_sec']:.3f} s, network {row['network_sec']:.3f} s "
          f"for {row['collective_bytes'] / 1e9:.2f} GB over {link}")


def does_not_fit_message(rows: Sequence[dict[str, Any]], hardware: str) -> str | None:
  """Plain words for a profile on which one device cannot hold the run: what it needs, and what would fit."""
  single = [r for r in rows if r["hardware"] == hardware and r["devices"] == 1 and not r["remat_fallback"]]
  if not single or single[0]["fits"]:
    return None
  r = single[0]
  needed = r["predicted_memory_gib"]
  text = (f"does not fit on one {hardware}: even {r['grad_accum']} micro-batches of {r['micro_batch']} sequences "
          f"need {needed:.1f} GiB per device, {r['usable_memory_gib']:.1f} GiB usable")
  best = recommend(rows, hardware)
  if best is None:
    return text + f"; no mesh of up to {max(x['devices'] for x in rows if x['hardware'] == hardware)} devices fits"
  return (text + f"; fits on {best['devices']} devices with mesh data x fsdp x tensor x pipeline = {best['mesh']} "
          f"({best['layout']}) and train.grad_accum={best['grad_accum']}"
          + (" and kernels.remat=full" if best["remat_fallback"] else "")
          + f" ({best['predicted_memory_gib']:.1f} GiB per device)")
