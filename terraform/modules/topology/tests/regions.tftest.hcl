# Regions: cloud placement, subnets, router replicas and the Redis primary, derived from
# regions.yaml files under tests/fixtures.

variables {
  config = yamldecode(file("tests/fixtures/three_regions.yaml"))
  model_settings = {
    "tiny-llama" = { source = "TinyLlama/TinyLlama-1.1B-Chat-v1.0" }
    "tiny-coder" = { source = "Qwen/Qwen2.5-Coder-1.5B-Instruct" }
  }
}

run "every_region_is_placed" {
  command = plan

  assert {
    condition     = toset(keys(output.regions)) == toset(["us-east", "eu-west", "ap-south"])
    error_message = "one entry per region of regions.yaml"
  }
  assert {
    condition = (output.regions["us-east"].cloud_region == "us-east4"
      && output.regions["eu-west"].cloud_region == "europe-west4"
    && output.regions["ap-south"].cloud_region == "asia-south1")
    error_message = "the repository's logical names map to L4 regions"
  }
  assert {
    condition     = length(distinct([for r in values(output.regions) : r.subnet_cidr])) == 3
    error_message = "every region has its own subnet"
  }
  assert {
    condition = alltrue([
      for r in values(output.regions) :
      endswith(r.subnet_cidr, "/20") && cidrsubnet(r.subnet_cidr, 0, 0) == r.subnet_cidr
      && startswith(r.subnet_cidr, "10.")
    ])
    error_message = "subnets are /20s carved from network_cidr"
  }
}

run "routers_and_redis_follow_regions_yaml" {
  command = plan

  assert {
    condition     = output.redis_primary_region == "us-east"
    error_message = "the Redis primary defaults to router.region"
  }
  assert {
    condition     = [for name in sort(keys(output.regions)) : output.regions[name].redis.role] == ["replica", "replica", "primary"]
    error_message = "exactly one primary (us-east), a replica in every other region"
  }
  assert {
    condition     = alltrue([for r in values(output.regions) : r.router.replicas == 2 && r.router.machine_type == "e2-standard-2"])
    error_message = "two router replicas per region by default"
  }
  assert {
    condition     = alltrue([for r in values(output.regions) : r.router.max_replicas == 6 && r.router.cpu_target == 0.6])
    error_message = "the routers autoscale on CPU (60 %) up to three times their minimum by default"
  }
  assert {
    condition = (output.redis.service == "globalpool" && output.redis.nodes == 3 && output.redis.quorum == 2
    && output.redis.initial_primary_region == "us-east")
    error_message = "three Redis nodes: the sentinels' quorum is two, a majority"
  }
  assert {
    condition     = output.redis.down_after_ms + 6000 <= 10000 && output.redis.failover_timeout_ms >= 3000 && output.redis.failover_timeout_ms <= 10000
    error_message = "a lost primary is noticed early enough for the failover to fit in 10 s (the failover budget in main.tf); an attempt is neither abandoned before a promotion across regions can finish nor retried only minutes later"
  }
  assert {
    condition     = output.regions["eu-west"].redis.zone == "europe-west4-b"
    error_message = "the Redis node sits in zone -b of its region by default"
  }
  assert {
    condition     = output.router.port == 8080 && output.router.lb_timeout_s == 930
    error_message = "the routers' port and the load balancer timeout come from router.port and router.timeouts.total_s"
  }
  assert {
    condition = (output.worker.key_prefix == "globalpool" && output.worker.heartbeat_interval_s == 0.5
    && output.worker.heartbeat_ttl_s == 2 && output.worker.engine_port == 8000)
    error_message = "worker flags come from redis.key_prefix and heartbeat.*"
  }
}

run "region_settings_override_the_defaults" {
  command = plan

  variables {
    region_settings = {
      "ap-south" = {
        cloud_region       = "asia-south2"
        zones              = ["asia-south2-a", "asia-south2-c"]
        router_replicas    = 3
        redis_machine_type = "n2-highmem-2"
      }
      "eu-west" = { subnet_cidr = "10.200.0.0/20", redis_zone = "europe-west4-c", router_max_replicas = 4 }
    }
    defaults             = { router_machine_type = "n2-standard-4", router_cpu_target = 0.75 }
    redis_primary_region = "eu-west"
  }

  assert {
    condition = (output.regions["ap-south"].cloud_region == "asia-south2"
      && output.regions["ap-south"].zones == tolist(["asia-south2-a", "asia-south2-c"])
    && output.regions["ap-south"].router.replicas == 3)
    error_message = "a region's own settings win"
  }
  assert {
    condition     = output.regions["ap-south"].redis.zone == "asia-south2-a" && output.regions["ap-south"].redis.machine_type == "n2-highmem-2"
    error_message = "Redis follows the region's first zone and its own machine type"
  }
  assert {
    condition     = output.regions["eu-west"].subnet_cidr == "10.200.0.0/20" && output.regions["eu-west"].redis.zone == "europe-west4-c"
    error_message = "an explicit subnet range and Redis zone are kept"
  }
  assert {
    condition     = output.regions["us-east"].router.machine_type == "n2-standard-4" && output.regions["us-east"].router.replicas == 2
    error_message = "defaults apply where a region says nothing"
  }
  assert {
    condition = (output.regions["ap-south"].router.max_replicas == 9 && output.regions["eu-west"].router.max_replicas == 4
    && output.regions["us-east"].router.cpu_target == 0.75)
    error_message = "the autoscaler's maximum follows the region's minimum unless the region sets it; the CPU target comes from defaults"
  }
  assert {
    condition = (output.redis_primary_region == "eu-west" && output.regions["eu-west"].redis.role == "primary"
    && output.regions["us-east"].redis.role == "replica" && output.redis.initial_primary_region == "eu-west")
    error_message = "redis_primary_region names the initial primary"
  }
}

run "the_quorum_is_a_majority_of_the_redis_nodes" {
  command = plan

  variables {
    config = {
      apiVersion = "globalpool/v1"
      regions = {
        "us-east"  = { models = ["tiny-llama"] }, "eu-west" = { models = ["tiny-llama"] },
        "ap-south" = { models = ["tiny-llama"] }, "us-west" = { models = ["tiny-llama"] },
        "eu-north" = { models = ["tiny-llama"] },
      }
    }
  }

  assert {
    condition     = output.redis.nodes == 5 && output.redis.quorum == 3
    error_message = "five nodes: three sentinels must agree (any two regions may be lost)"
  }
}

run "two_regions_need_both_sentinels" {
  command = plan

  variables {
    config = {
      apiVersion = "globalpool/v1"
      regions    = { "us-east" = { models = ["tiny-llama"] }, "eu-west" = { models = ["tiny-llama"] } }
    }
  }

  assert {
    condition     = output.redis.nodes == 2 && output.redis.quorum == 2
    error_message = "two nodes: a majority is both, so losing either region stops automatic failover (hence >= 3 regions)"
  }
}
