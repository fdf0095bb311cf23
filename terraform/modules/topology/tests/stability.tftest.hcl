# Adding a region must not move anything that already runs: its subnet, names and pools
# stay as they were, so the plan only adds.

variables {
  model_settings = {
    "tiny-llama" = { source = "TinyLlama/TinyLlama-1.1B-Chat-v1.0" }
    "tiny-coder" = { source = "Qwen/Qwen2.5-Coder-1.5B-Instruct" }
  }
}

run "before" {
  command = plan

  variables {
    config = yamldecode(file("tests/fixtures/three_regions.yaml"))
  }
}

run "after_adding_ap_northeast" {
  command = plan

  variables {
    config = yamldecode(file("tests/fixtures/four_regions.yaml"))
  }

  assert {
    condition     = alltrue([for name, region in run.before.regions : output.regions[name].subnet_cidr == region.subnet_cidr])
    error_message = "existing subnets keep their ranges"
  }
  assert {
    condition = alltrue([for name, region in run.before.regions : (
      output.regions[name].router.name == region.router.name && output.regions[name].redis.name == region.redis.name
    && output.regions[name].subnet_name == region.subnet_name)])
    error_message = "existing routers, Redis nodes and subnets keep their names"
  }
  assert {
    condition     = alltrue([for key, pool in run.before.gpu_pools : output.gpu_pools[key].name == pool.name])
    error_message = "existing pools keep their names"
  }
  assert {
    condition     = output.regions["ap-northeast"].cloud_region == "asia-northeast1" && !contains([for r in values(run.before.regions) : r.subnet_cidr], output.regions["ap-northeast"].subnet_cidr)
    error_message = "the new region gets a subnet of its own"
  }
  assert {
    condition     = output.redis_primary_region == run.before.redis_primary_region
    error_message = "the Redis primary stays where it was"
  }
  assert {
    condition     = run.before.redis.quorum == 2 && output.redis.nodes == 4 && output.redis.quorum == 3
    error_message = "a fourth Redis node raises the quorum to three, a majority of four"
  }
}
