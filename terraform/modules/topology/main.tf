# The topology: which regions, which pools (region x model), how many replicas, which
# Redis is the primary, the subnet of each region and every resource name. Pure
# expressions over regions.yaml and the deployment settings; no provider.

terraform {
  required_version = ">= 1.9"
}

locals {
  engine_port = 8000

  # regions.yaml, read key by key with defaults. Keys not named here are ignored.
  region_names = sort(keys(var.config.regions))
  region_doc   = { for name in local.region_names : name => var.config.regions[name] }
  region_models = {
    for name, doc in local.region_doc : name => distinct([for model in try(doc.models, []) : tostring(model)])
  }
  key_prefix           = try(tostring(var.config.redis.key_prefix), "globalpool")
  heartbeat_interval_s = try(tonumber(var.config.heartbeat.interval_s), 0.5)
  heartbeat_ttl_s      = try(tonumber(var.config.heartbeat.ttl_s), 2.0)
  configured_port      = try(tonumber(var.config.router.port), 8080)
  # Port 0 means "any free port" on a laptop; a load balancer needs a fixed one.
  router_port     = local.configured_port > 0 ? local.configured_port : 8080
  router_total_s  = try(tonumber(var.config.router.timeouts.total_s), 900)
  router_region   = try(tostring(var.config.router.region), null)
  all_model_names = sort(distinct(flatten(values(local.region_models))))
  admin_token_env = try(tostring(var.config.admin.token_env), "GLOBALPOOL_ADMIN_TOKEN")
  keys_file       = try(tostring(var.config.auth.keys_file), null)
  upstream_key_envs = sort(distinct(compact([
    for doc in values(local.region_doc) : try(tostring(doc.upstream_api_key_env), "")
  ])))

  # Common logical names -> Compute Engine regions with L4 GPUs. A region of regions.yaml
  # that is already a Compute Engine name (us-central1) maps to itself.
  known_cloud_regions = {
    "us-east"      = "us-east4"
    "us-central"   = "us-central1"
    "us-west"      = "us-west1"
    "eu-west"      = "europe-west4"
    "eu-central"   = "europe-west3"
    "eu-north"     = "europe-north1"
    "ap-south"     = "asia-south1"
    "ap-southeast" = "asia-southeast1"
    "ap-northeast" = "asia-northeast1"
    "ap-east"      = "asia-east1"
    "sa-east"      = "southamerica-east1"
    "au-southeast" = "australia-southeast1"
  }

  # One /20 slot per Compute Engine region, by position in this list: APPEND ONLY, so
  # that adding a region to regions.yaml never renumbers an existing subnet.
  cidr_slots = [
    "us-central1", "us-east1", "us-east4", "us-east5", "us-south1", "us-west1", "us-west2",
    "us-west3", "us-west4", "northamerica-northeast1", "northamerica-northeast2",
    "southamerica-east1", "southamerica-west1", "europe-west1", "europe-west2",
    "europe-west3", "europe-west4", "europe-west6", "europe-west8", "europe-west9",
    "europe-west10", "europe-west12", "europe-north1", "europe-central2",
    "europe-southwest1", "asia-south1", "asia-south2", "asia-southeast1",
    "asia-southeast2", "asia-east1", "asia-east2", "asia-northeast1", "asia-northeast2",
    "asia-northeast3", "australia-southeast1", "australia-southeast2", "me-west1",
    "me-central1", "me-central2", "africa-south1",
  ]

  region_setting = { for name in local.region_names : name => lookup(var.region_settings, name, null) }

  cloud_region = {
    for name in local.region_names : name => try(coalesce(
      try(local.region_setting[name].cloud_region, null),
      lookup(local.known_cloud_regions, name, null),
      can(regex("^[a-z]+-[a-z]+[0-9]+$", name)) ? name : null,
    ), null)
  }

  subnet_cidr = {
    for name in local.region_names : name => try(coalesce(
      try(local.region_setting[name].subnet_cidr, null),
      try(cidrsubnet(var.network_cidr, 10, index(local.cidr_slots, local.cloud_region[name])), null),
    ), null)
  }

  redis_primary_region = coalesce(
    var.redis_primary_region,
    contains(local.region_names, coalesce(local.router_region, "\n")) ? local.router_region : local.region_names[0],
  )

  # The routers' autoscaler keeps between `replicas` (the minimum) and `max_replicas`.
  router_replicas = {
    for name in local.region_names : name => coalesce(try(local.region_setting[name].router_replicas, null), var.defaults.router_replicas)
  }

  # Redis: one node per region, each running redis-server and a sentinel. The sentinels
  # promote a replica when a majority of them (the quorum) agree that the primary is down,
  # so the two sides of a partition can never both promote one. With three or more
  # regions the loss of any one leaves a majority; with two, the one left is no majority
  # and does not fail over.
  #
  # Failover budget, the primary's region lost at t = 0 (issue #25: routers elsewhere see
  # fresh heartbeats again within 10 s, and route from their last view until then):
  #   down_after_ms        3.0 s  every sentinel marks the primary down (no valid PING
  #                               reply for this long; sentinels PING every second)
  #   agreement, election  ~1 s   the sentinels ask each other once a second, then vote a
  #                               leader (one round trip between regions, ~0.2 s, plus up
  #                               to 1 s of random desync that keeps votes from splitting)
  #   promotion            ~1 s   REPLICAOF NO ONE to the best replica; the leader polls
  #                               its INFO every second during a failover
  #   clients              <= 3 s agents write a heartbeat every 0.5 s: the write to the
  #                               lost primary times out in 1 s, the next connection asks
  #                               the sentinels (which skip a primary they see down) and
  #                               lands on the new one; routers retry with a backoff capped
  #                               at 2 s, then a full read
  #   total                ~7-9 s
  # failover_timeout_ms bounds one attempt: a leader election or a promotion that has not
  # happened after 5 s is abandoned and retried 2 x 5 s after it began (Redis's default,
  # 180 s, would retry only after six minutes). It cannot buy a second attempt inside the
  # 10 s; it keeps a first attempt that is slow across regions from being abandoned.
  redis_nodes = length(local.region_names)
  redis = {
    service                = "globalpool"
    initial_primary_region = local.redis_primary_region
    nodes                  = local.redis_nodes
    quorum                 = floor(local.redis_nodes / 2) + 1
    down_after_ms          = 3000
    failover_timeout_ms    = 5000
  }

  regions = {
    for name in local.region_names : name => {
      name         = name
      cloud_region = local.cloud_region[name]
      zones        = try(local.region_setting[name].zones, null)
      subnet_cidr  = local.subnet_cidr[name]
      subnet_name  = local.short_name["${name}/subnet"]
      models       = local.region_models[name]
      router = {
        name         = local.short_name["${name}/router"]
        replicas     = local.router_replicas[name]
        max_replicas = coalesce(try(local.region_setting[name].router_max_replicas, null), var.defaults.router_max_replicas, 3 * local.router_replicas[name])
        cpu_target   = var.defaults.router_cpu_target
        machine_type = coalesce(try(local.region_setting[name].router_machine_type, null), var.defaults.router_machine_type)
      }
      redis = {
        name = local.short_name["${name}/redis"]
        # The role at the deployment's first boot; the sentinels move the primary after that.
        role         = name == local.redis_primary_region ? "primary" : "replica"
        machine_type = coalesce(try(local.region_setting[name].redis_machine_type, null), var.defaults.redis_machine_type)
        zone = coalesce(
          try(local.region_setting[name].redis_zone, null),
          try(local.region_setting[name].zones[0], null),
          "${coalesce(local.cloud_region[name], "unknown")}-b",
        )
      }
    }
  }

  # GPU pools: one per (region, model served there).
  pool_keys = flatten([
    for region in local.region_names : [
      for model in local.region_models[region] : { key = "${region}/${model}", region = region, model = model }
    ]
  ])

  pool_settings = {
    for pool in local.pool_keys : pool.key => {
      region    = pool.region
      model     = pool.model
      pool_cfg  = try(local.region_setting[pool.region].gpu_pools[pool.model], null)
      model_cfg = lookup(var.model_settings, pool.model, null)
    }
  }

  pools = {
    for key, s in local.pool_settings : key => merge(s, {
      replicas     = coalesce(try(s.pool_cfg.replicas, null), try(s.model_cfg.replicas, null), var.defaults.gpu_replicas)
      machine_type = coalesce(try(s.pool_cfg.machine_type, null), try(s.model_cfg.machine_type, null), var.defaults.gpu_machine_type)
      gpu_type     = coalesce(try(s.pool_cfg.gpu_type, null), try(s.model_cfg.gpu_type, null), var.defaults.gpu_type)
      gpu_count    = coalesce(try(s.pool_cfg.gpu_count, null), try(s.model_cfg.gpu_count, null), var.defaults.gpu_count)
      spot         = coalesce(try(s.pool_cfg.spot, null), var.defaults.spot)
      disk_gb      = coalesce(try(s.model_cfg.disk_gb, null), var.defaults.gpu_disk_gb)
      max_num_seqs = coalesce(try(s.model_cfg.max_num_seqs, null), var.defaults.max_num_seqs)
      source       = try(s.model_cfg.source, null)
      extra_args   = try(s.model_cfg.vllm_args, [])
    })
  }

  gpu_pools = {
    for key, p in local.pools : key => {
      name         = local.short_name[key]
      region       = p.region
      model        = p.model
      cloud_region = local.cloud_region[p.region]
      zones        = try(local.region_setting[p.region].zones, null)
      source       = p.source
      replicas     = p.replicas
      machine_type = p.machine_type
      gpu_type     = p.gpu_type
      gpu_count    = p.gpu_count
      spot         = p.spot
      disk_gb      = p.disk_gb
      disk_type    = var.defaults.gpu_disk_type
      boot_s       = var.defaults.gpu_boot_s
      max_num_seqs = p.max_num_seqs
      engine_port  = local.engine_port
      vllm_argv = concat(
        [coalesce(p.source, "UNSET")],
        ["--served-model-name", p.model, "--host", "0.0.0.0", "--port", tostring(local.engine_port)],
        ["--max-num-seqs", tostring(p.max_num_seqs)],
        p.gpu_count > 1 && !anytrue([for arg in p.extra_args : contains(["--tensor-parallel-size", "-tp"], split("=", arg)[0])]) ? ["--tensor-parallel-size", tostring(p.gpu_count)] : [],
        p.extra_args,
      )
    }
  }

  # Cloud resource names: <prefix>-<region>-<what>, lowercase letters, digits and '-',
  # at most 40 characters (room for the suffixes that instance groups append). A longer
  # name is cut and ends in a hash of the full key, so it stays unique and stable.
  name_keys = concat(
    [for pool in local.pool_keys : { key = pool.key, raw = "${var.name_prefix}-${pool.region}-${pool.model}" }],
    flatten([
      for name in local.region_names : [
        for what in ["router", "redis", "subnet"] : { key = "${name}/${what}", raw = "${var.name_prefix}-${name}-${what}" }
      ]
    ]),
  )
  slug = { for item in local.name_keys : item.key => trim(replace(lower(item.raw), "/[^a-z0-9]+/", "-"), "-") }
  short_name = {
    for key, slug in local.slug : key => (
      length(slug) <= 40 ? slug : "${trim(substr(slug, 0, 33), "-")}-${substr(sha1(key), 0, 6)}"
    )
  }

  # The regions.yaml router replicas run with: the operator's, with batch.storage set to
  # the store that every replica shares (a `local` directory would hold each machine's
  # uploads apart). Re-encoded from the decoded document: comments go, every key and
  # value stays (router/config.py reads the result; tests/terraform checks it).
  router_regions_yaml = join("", [
    "# regions.yaml as Terraform deployed it (terraform/modules/topology: router_regions_yaml).\n",
    yamlencode(merge(var.config, var.batch_storage == null ? {} : {
      batch = merge(try(var.config.batch, null), { storage = var.batch_storage })
    })),
  ])

  # Where the deployment's bucket lives unless files_location says: the multi-region of
  # the home region's continent (the initial Redis primary's, i.e. router.region), so that
  # files survive the loss of any one region; elsewhere the home region itself, so that
  # data stays in its country.
  home_cloud_region = try(lower(local.cloud_region[local.redis_primary_region]), "")
  files_location = upper(
    startswith(local.home_cloud_region, "us-") ? "US"
    : startswith(local.home_cloud_region, "europe-") ? "EU"
    : startswith(local.home_cloud_region, "asia-") ? "ASIA"
    : local.home_cloud_region
  )

  # Problems that need more than one input to see; reported by output preconditions.
  unmapped_regions  = [for name in local.region_names : name if local.cloud_region[name] == null]
  uncarved_regions  = [for name in local.region_names : name if local.cloud_region[name] != null && local.subnet_cidr[name] == null]
  unsourced_models  = [for model in local.all_model_names : model if lookup(var.model_settings, model, null) == null]
  duplicate_subnets = length(compact(values(local.subnet_cidr))) != length(distinct(compact(values(local.subnet_cidr))))
  duplicate_names   = length(values(local.short_name)) != length(distinct(values(local.short_name)))
  invalid_pool_counts = concat(
    [for key, pool in local.gpu_pools : "${key}: replicas" if pool.replicas < 0 || floor(pool.replicas) != pool.replicas],
    [for key, pool in local.gpu_pools : "${key}: gpu_count" if pool.gpu_count < 1 || floor(pool.gpu_count) != pool.gpu_count],
    [for key, pool in local.gpu_pools : "${key}: max_num_seqs" if pool.max_num_seqs < 1 || floor(pool.max_num_seqs) != pool.max_num_seqs],
  )
  invalid_router_counts = [
    for name, region in local.regions : name if(
      region.router.replicas < 1 || floor(region.router.replicas) != region.router.replicas
      || region.router.max_replicas < region.router.replicas || floor(region.router.max_replicas) != region.router.max_replicas
    )
  ]
}
