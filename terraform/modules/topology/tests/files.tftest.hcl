# The Files and Batch APIs' bucket: the routers' regions.yaml names it as batch.storage,
# keeping everything else the operator wrote, and its default location follows the home
# region's continent.

variables {
  config = yamldecode(file("tests/fixtures/three_regions.yaml"))
  model_settings = {
    "tiny-llama" = { source = "TinyLlama/TinyLlama-1.1B-Chat-v1.0" }
    "tiny-coder" = { source = "Qwen/Qwen2.5-Coder-1.5B-Instruct" }
    "0.5"        = { source = "Qwen/Qwen2.5-0.5B-Instruct" }
  }
  batch_storage = "gs://gp-files-my-project/files"
}

run "the_routers_config_names_the_bucket" {
  command = plan

  assert {
    condition     = yamldecode(output.router_regions_yaml).batch == { storage = "gs://gp-files-my-project/files" }
    error_message = "a regions.yaml without a batch section gets batch.storage = the bucket, and nothing else"
  }
  assert {
    condition = alltrue([
      for key, value in var.config : yamldecode(output.router_regions_yaml)[key] == value
    ]) && length(yamldecode(output.router_regions_yaml)) == length(var.config) + 1
    error_message = "every other section of regions.yaml reaches the routers as it was"
  }
  assert {
    condition     = startswith(output.router_regions_yaml, "# ")
    error_message = "the file says where it comes from"
  }
}

run "the_operators_batch_settings_are_kept_and_storage_replaced" {
  command = plan

  variables {
    config = yamldecode(file("tests/fixtures/batch_limits.yaml"))
  }

  assert {
    condition = yamldecode(output.router_regions_yaml).batch == {
      enabled        = true
      storage        = "gs://gp-files-my-project/files"
      max_file_bytes = 8589934592
      max_lines      = 1000
      lease_s        = 45.5
    }
    error_message = "batch.storage: local becomes the bucket; the limits stay"
  }
  assert {
    condition = alltrue([
      for key, value in var.config : yamldecode(output.router_regions_yaml)[key] == value if key != "batch"
    ]) && length(yamldecode(output.router_regions_yaml)) == length(var.config)
    error_message = "every other section (strings that look like numbers or booleans, nulls, fractions) survives the re-encoding"
  }
  assert {
    condition     = output.files_location == "ASIA"
    error_message = "home region ap-south (asia-south1): the ASIA multi-region"
  }
}

run "without_batch_storage_the_file_is_unchanged" {
  command = plan

  variables {
    batch_storage = null
    config        = yamldecode(file("tests/fixtures/batch_limits.yaml"))
  }

  assert {
    condition     = yamldecode(output.router_regions_yaml) == var.config
    error_message = "batch_storage = null: the routers run regions.yaml as written"
  }
}

run "the_bucket_lives_on_the_home_regions_continent" {
  command = plan

  assert {
    condition     = output.files_location == "US"
    error_message = "home region us-east (us-east4): the US multi-region"
  }
}

run "the_home_region_follows_redis_primary_region" {
  command = plan

  variables {
    redis_primary_region = "eu-west"
  }

  assert {
    condition     = output.files_location == "EU"
    error_message = "home region eu-west (europe-west4): the EU multi-region"
  }
}

run "outside_us_europe_and_asia_the_home_region_itself" {
  command = plan

  variables {
    region_settings = { "us-east" = { cloud_region = "southamerica-east1" } }
  }

  assert {
    condition     = output.files_location == "SOUTHAMERICA-EAST1"
    error_message = "no multi-region on that continent: the home region keeps the data in its country"
  }
}

run "batch_storage_must_be_a_bucket" {
  command = plan

  variables {
    batch_storage = "local"
  }

  expect_failures = [var.batch_storage]
}
