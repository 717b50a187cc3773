"""Expert-parallelism load balancer (EPLB): which logical experts to replicate, and where each
physical copy goes, so that every GPU of an expert-parallel group receives about the same load.

The algorithm is DeepSeek's (github.com/deepseek-ai/EPLB), written again here as pure tensor
functions: loads in, maps out, no transport and no device. Loads are any per-expert statistic
(tokens routed over a window, a moving average); only their ratios matter.

Two greedy pieces do the work:
- replicate_experts: add redundant copies one at a time, each to the expert whose load per copy
  is currently the largest (a copy of expert e carries load[e] / copies[e]).
- balanced_packing: put n weighted items into m packs of exactly n/m items each, heaviest item
  first, each into the currently lightest pack that still has room (LPT with a size cap).

The hierarchical policy (num_groups % num_nodes == 0) keeps group-limited routing cheap: it packs
whole expert groups onto nodes (balanced_packing over group loads), replicates experts within
each node (replicate_experts over the node's experts and its share of the slots), then packs the
node's physical experts onto its GPUs (balanced_packing over per-copy loads). Otherwise the global
policy is the same pipeline with one group on one node: replicate over all experts, then pack
onto all GPUs.

Cost, per layer, with E logical experts, P physical slots, G GPUs: replication is
O(E · (P - E)) (one argmax per redundant slot, all layers at once); packing is a Python loop of
O(P · G / nodes) per layer (O(groups · nodes) for the node step). It runs on the CPU between
load snapshots, off the serving hot path.

Ties go to the lowest index everywhere (stable sort, first argmax, first lightest pack), so the
result is a pure function of the loads. (DeepSeek's code sorts unstably, so on tied loads its
placement may differ from this one; on the tied loads we compared, the imbalance did not.) Packing knows loads, not
experts: two copies of one expert may land on the same GPU, where the second copy buys nothing.
"""
from __future__ import annotations

import torch


def balanced_packing(weight: torch.Tensor, num_packs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack each row's n weighted items into num_packs packs of exactly n / num_packs items.

    weight: [X, n]. Returns (pack_index [X, n], rank_in_pack [X, n]), int64 on CPU: item i of
    row x goes to pack pack_index[x, i] as its rank_in_pack[x, i]-th item (0-based, in the order
    it was placed). When each pack takes a single item every assignment is equally balanced, so
    items stay where they are (item i in pack i) and nothing moves needlessly.
    Raises ValueError when n is not a multiple of num_packs.
    """
    rows, n = weight.shape
    if num_packs <= 0 or n % num_packs:
        raise ValueError(f"cannot pack {n} items into {num_packs} equal packs: "
                         f"the item count must be a positive multiple of num_packs")
    per_pack = n // num_packs
    if per_pack == 1:
        return torch.arange(n).expand(rows, n).clone(), torch.zeros(rows, n, dtype=torch.int64)
    loads = weight.detach().float().cpu()
    order = loads.sort(dim=-1, descending=True, stable=True).indices.tolist()
    pack_index = torch.empty(rows, n, dtype=torch.int64)
    rank_in_pack = torch.empty(rows, n, dtype=torch.int64)
    for x, (row, items) in enumerate(zip(loads.tolist(), order, strict=True)):
        packs, ranks = _pack_row(row, items, num_packs, per_pack)
        pack_index[x] = torch.tensor(packs)
        rank_in_pack[x] = torch.tensor(ranks)
    return pack_index, rank_in_pack


def _pack_row(load: list[float], items: list[int], num_packs: int, per_pack: int) -> tuple[list[int], list[int]]:
    """One row of balanced_packing: items arrive heaviest first; returns (pack, rank) per item."""
    pack_load = [0.0] * num_packs
    pack_size = [0] * num_packs
    packs, ranks = [0] * len(load), [0] * len(load)
    for item in items:
        open_packs = (p for p in range(num_packs) if pack_size[p] < per_pack)
        pack = min(open_packs, key=pack_load.__getitem__)
        packs[item], ranks[item] = pack, pack_size[pack]
        pack_load[pack] += load[item]
        pack_size[pack] += 1
    return packs, ranks


def replicate_experts(weight: torch.Tensor, num_phy: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Spread num_log logical experts over num_phy >= num_log physical slots, per row.

    weight: [X, num_log]. Slots 0..num_log-1 hold each expert once, in order; each further slot
    holds a copy of the expert whose load per copy is then the largest. Returns, int64 on CPU,
    phy2log [X, num_phy] (the logical expert in each slot), rank [X, num_phy] (which copy of its
    expert the slot is, 0 for the original) and logcnt [X, num_log] (copies per expert, >= 1).
    """
    rows, num_log = weight.shape
    if num_phy < num_log:
        raise ValueError(f"{num_phy} physical slots cannot hold {num_log} logical experts")
    load = weight.detach().float().cpu()
    phy2log = torch.arange(num_log).repeat(rows, 1)  # [X, num_log], grows to [X, num_phy]
    rank = torch.zeros(rows, num_log, dtype=torch.int64)
    logcnt = torch.ones(rows, num_log, dtype=torch.int64)
    row_ids = torch.arange(rows)
    new_slots, new_ranks = [], []
    for _ in range(num_phy - num_log):
        hottest = (load / logcnt).argmax(dim=-1)  # [X]: the first of equals
        new_slots.append(hottest)
        new_ranks.append(logcnt[row_ids, hottest].clone())
        logcnt[row_ids, hottest] += 1
    if new_slots:
        phy2log = torch.cat([phy2log, torch.stack(new_slots, dim=-1)], dim=-1)
        rank = torch.cat([rank, torch.stack(new_ranks, dim=-1)], dim=-1)
    return phy2log, rank, logcnt


def rebalance_experts_hierarchical(weight: torch.Tensor, num_physical_experts: int, num_groups: int,
                                   num_nodes: int, num_gpus: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The hierarchical policy: groups to nodes, copies within nodes, copies to the node's GPUs.

    weight: [L, E] loads. Physical slot s lives on GPU s // (num_physical_experts / num_gpus);
    GPUs n·(num_gpus/num_nodes) .. (n+1)·(num_gpus/num_nodes)-1 form node n. Returns
    (phy2log [L, P], phyrank [L, P], logcnt [L, E]), int64 on CPU; every copy of an expert sits
    on the node its group went to. Raises ValueError on a layout that does not divide evenly.
    """
    _check_layout(weight, num_physical_experts, num_groups, num_nodes, num_gpus, hierarchical=True)
    load = weight.detach().float().cpu()
    layers, num_log = load.shape
    log2mlog = _pack_groups_to_nodes(load, num_groups, num_nodes)  # [L, E]
    mlog2log = _inverse(log2mlog)  # [L, E]: node-major order -> logical id
    node_load = load.gather(-1, mlog2log).view(layers * num_nodes, num_log // num_nodes)
    phy2mlog, phyrank, mlogcnt = replicate_experts(node_load, num_physical_experts // num_nodes)
    copy_load = (node_load / mlogcnt).gather(-1, phy2mlog)  # [L·nodes, P/nodes]
    gpu, slot = balanced_packing(copy_load, num_gpus // num_nodes)
    phy2pphy = gpu * (num_physical_experts // num_gpus) + slot  # replica -> slot on its node
    pphy2phy = _inverse(phy2pphy)
    node_base = torch.arange(num_nodes).repeat(layers).unsqueeze(-1) * (num_log // num_nodes)
    pphy2mlog = (phy2mlog.gather(-1, pphy2phy) + node_base).view(layers, -1)  # [L, P]
    phy2log = mlog2log.gather(-1, pphy2mlog)
    phyrank = phyrank.gather(-1, pphy2phy).view(layers, -1)
    logcnt = mlogcnt.view(layers, -1).gather(-1, log2mlog)
    return phy2log, phyrank, logcnt


def _pack_groups_to_nodes(load: torch.Tensor, num_groups: int, num_nodes: int) -> torch.Tensor:
    """[L, E] loads -> log2mlog [L, E]: each expert's position when the experts are listed node by
    node (node n owns positions n·E/nodes ..), its group's slot on the node, then its place in
    the group. Groups move whole; balanced_packing evens the node loads."""
    layers, num_log = load.shape
    group_size = num_log // num_groups
    group_load = load.view(layers, num_groups, group_size).sum(-1)  # [L, groups]
    node, slot = balanced_packing(group_load, num_nodes)
    first = (node * (num_groups // num_nodes) + slot) * group_size  # [L, groups]
    return (first.unsqueeze(-1) + torch.arange(group_size)).flatten(-2)


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    """The inverse of each row's permutation: [R, n] -> [R, n]."""
    inv = torch.empty_like(perm)
    inv.scatter_(-1, perm, torch.arange(perm.size(-1)).expand_as(perm).contiguous())
    return inv


def rebalance_experts(weight: torch.Tensor, num_replicas: int, num_groups: int, num_nodes: int,
                      num_gpus: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The balancer's entry point: a placement of num_replicas physical experts per layer.

    weight: [layers, num_logical] loads, float or int, any device (computed in float on CPU).
    Hierarchical policy when num_groups % num_nodes == 0, else the global one (one group, one
    node). GPU g holds physical experts g·k .. (g+1)·k-1, k = num_replicas / num_gpus.
    Returns, int64 on CPU:
      phy2log [layers, num_replicas]: the logical expert of each physical expert;
      log2phy [layers, num_logical, max_copies]: each expert's physical experts, -1 padded;
      logcnt  [layers, num_logical]: copies per logical expert (>= 1, sums to num_replicas).
    Raises ValueError naming the problem when the layout does not divide evenly.
    """
    _check_layout(weight, num_replicas, num_groups, num_nodes, num_gpus, hierarchical=False)
    if num_groups % num_nodes == 0:
        phy2log, phyrank, logcnt = rebalance_experts_hierarchical(weight, num_replicas, num_groups,
                                                                  num_nodes, num_gpus)
    else:
        phy2log, phyrank, logcnt = rebalance_experts_hierarchical(weight, num_replicas, 1, 1, num_gpus)
    return phy2log, _log2phy(phy2log, phyrank, logcnt), logcnt


def _log2phy(phy2log: torch.Tensor, phyrank: torch.Tensor, logcnt: torch.Tensor) -> torch.Tensor:
    """[L, P] maps and [L, E] counts -> [L, E, max_copies]: copy r of expert e is in slot [l, e, r]."""
    layers, num_phy = phy2log.shape
    width = int(logcnt.max())
    out = torch.full((layers, logcnt.size(-1) * width), -1, dtype=torch.int64)
    out.scatter_(-1, phy2log * width + phyrank, torch.arange(num_phy).expand(layers, num_phy).contiguous())
    return out.view(layers, -1, width)


def gpu_loads(weight: torch.Tensor, phy2log: torch.Tensor, logcnt: torch.Tensor, num_gpus: int) -> torch.Tensor:
    """The load each GPU receives under a placement: [layers, num_gpus], float32.

    weight: [layers, num_logical]; phy2log: [layers, P]; logcnt: [layers, num_logical]. A physical
    expert takes its logical expert's load over that expert's copy count (tokens split evenly
    among copies); GPU g sums physical experts g·P/num_gpus .. (g+1)·P/num_gpus-1.
    """
    layers, num_phy = phy2log.shape
    if num_gpus <= 0 or num_phy % num_gpus:
        raise ValueError(f"{num_phy} physical experts do not split evenly over num_gpus={num_gpus}")
    if weight.shape != logcnt.shape or weight.size(0) != layers:
        raise ValueError(f"weight {tuple(weight.shape)}, logcnt {tuple(logcnt.shape)} and phy2log "
                         f"{tuple(phy2log.shape)} must agree on [layers, num_logical] / [layers, P]")
    weight, phy2log, logcnt = weight.detach().float().cpu(), phy2log.cpu(), logcnt.cpu()
    per_copy = weight.gather(-1, phy2log) / logcnt.gather(-1, phy2log).float()  # [layers, P]
    return per_copy.view(layers, num_gpus, num_phy // num_gpus).sum(-1)


def imbalance(loads: torch.Tensor) -> torch.Tensor:
    """Max over mean load per rank along the last dim: [..., num_gpus] -> [...]; 1.0 is perfect.
    An all-zero row counts as balanced (1.0) rather than 0/0."""
    loads = loads.float()
    mean = loads.mean(dim=-1)
    peak = loads.amax(dim=-1)
    return torch.where(mean > 0, peak / mean.clamp_min(torch.finfo(torch.float32).tiny), torch.ones_like(mean))


def _check_layout(weight: torch.Tensor, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int,
                  hierarchical: bool) -> None:
    """ValueError naming the first way the loads or the layout cannot be balanced."""
    if weight.dim() != 2 or weight.size(-1) == 0:
        raise ValueError(f"weight must be [layers, num_logical_experts] with experts, got shape {tuple(weight.shape)}")
    if weight.is_complex() or weight.dtype == torch.bool:
        raise ValueError(f"weight must hold real-valued loads, got dtype {weight.dtype}")
    if not bool(torch.isfinite(weight.float()).all()) or bool((weight < 0).any()):
        raise ValueError("weight must hold finite, non-negative loads")
    num_logical = weight.size(-1)
    for name, value in (("num_groups", num_groups), ("num_nodes", num_nodes), ("num_gpus", num_gpus)):
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
    if num_replicas < num_logical:
        raise ValueError(f"num_replicas={num_replicas} is fewer than the {num_logical} logical experts: "
                         f"every expert needs at least one physical copy")
    if num_replicas % num_gpus:
        raise ValueError(f"num_replicas={num_replicas} must be a multiple of num_gpus={num_gpus}")
    if num_gpus % num_nodes:
        raise ValueError(f"num_gpus={num_gpus} must be a multiple of num_nodes={num_nodes}")
    if num_logical % num_groups:
        raise ValueError(f"the {num_logical} logical experts do not split into num_groups={num_groups} equal groups")
    if hierarchical and num_groups % num_nodes:
        raise ValueError(f"the hierarchical policy needs num_groups={num_groups} to be a multiple of "
                         f"num_nodes={num_nodes}")
