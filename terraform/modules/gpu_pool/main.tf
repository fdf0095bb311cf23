# One GPU pool: a regional managed instance group of GPU machines, each running vLLM
# under the globalpool worker agent (scripts/gpu-worker.sh), autohealed on vLLM's /health.

terraform {
  required_version = ">= 1.9"
  required_providers {
    google = {
      source  = "hashicorp/google"
      version = ">= 6.0, < 8.0"
    }
  }
}

variable "project_id" {
  description = "The Google Cloud project."
  type        = string
}

variable "pool" {
  description = "One entry of the topology module's gpu_pools output."
  type = object({
    name         = string
    region       = string
    model        = string
    cloud_region = string
    zones        = optional(list(string))
    replicas     = number
    machine_type = string
    gpu_type     = string
    gpu_count    = number
    spot         = bool
    disk_gb      = number
    disk_type    = string
    boot_s       = number
    engine_port  = number
    max_num_seqs = number
    vllm_argv    = list(string)
  })
}

variable "subnetwork" {
  description = "The region's subnetwork id."
  type        = string
}

variable "service_account" {
  description = "The workers' service account email."
  type        = string
}

variable "image" {
  description = "Boot image with the NVIDIA driver (a Deep Learning VM image family)."
  type        = string
}

variable "settings" {
  description = "Everything else the start-up script reads (pip specs, Redis host, secret ids, heartbeat settings); no secret values."
  type        = any
}

variable "labels" {
  description = "Labels on the machines."
  type        = map(string)
  default     = {}
}

locals {
  drain_timeout_s = 30
  startup_script = join("\n", [
    "#!/bin/bash",
    file("${path.module}/../../scripts/lib.sh"),
    file("${path.module}/../../scripts/gpu-worker.sh"),
  ])
  settings = merge(var.settings, {
    region          = var.pool.region
    model           = var.pool.model
    vllm_argv       = var.pool.vllm_argv
    max_num_seqs    = var.pool.max_num_seqs
    engine_port     = var.pool.engine_port
    drain_timeout_s = local.drain_timeout_s
    start_timeout_s = var.pool.boot_s
  })
  labels = merge(var.labels, {
    globalpool-kind   = "worker"
    globalpool-region = var.pool.region
  })
}

resource "google_compute_instance_template" "worker" {
  project      = var.project_id
  name_prefix  = "${var.pool.name}-"
  machine_type = var.pool.machine_type
  labels       = local.labels

  disk {
    source_image = var.image
    disk_size_gb = var.pool.disk_gb
    disk_type    = var.pool.disk_type
    boot         = true
    auto_delete  = true
  }

  guest_accelerator {
    type  = var.pool.gpu_type
    count = var.pool.gpu_count
  }

  # GPUs cannot live-migrate: maintenance stops the machine, the group replaces it.
  scheduling {
    on_host_maintenance         = "TERMINATE"
    automatic_restart           = !var.pool.spot
    preemptible                 = var.pool.spot
    provisioning_model          = var.pool.spot ? "SPOT" : "STANDARD"
    instance_termination_action = var.pool.spot ? "DELETE" : null
  }

  network_interface {
    subnetwork = var.subnetwork
  }

  service_account {
    email  = var.service_account
    scopes = ["cloud-platform"]
  }

  shielded_instance_config {
    # The driver in Deep Learning VM images is not signed for Secure Boot.
    enable_secure_boot          = false
    enable_vtpm                 = true
    enable_integrity_monitoring = true
  }

  metadata = {
    startup-script         = local.startup_script
    globalpool-settings    = jsonencode(local.settings)
    install-nvidia-driver  = "True"
    enable-oslogin         = "TRUE"
    block-project-ssh-keys = "true"
    serial-port-enable     = "false"
  }

  lifecycle {
    create_before_destroy = true
  }
}

resource "google_compute_health_check" "engine" {
  project             = var.project_id
  name                = "${var.pool.name}-hc"
  check_interval_sec  = 10
  timeout_sec         = 5
  healthy_threshold   = 1
  unhealthy_threshold = 6

  http_health_check {
    port         = var.pool.engine_port
    request_path = "/health"
  }

  log_config {
    enable = true
  }
}

resource "google_compute_region_instance_group_manager" "pool" {
  project            = var.project_id
  name               = var.pool.name
  region             = var.pool.cloud_region
  base_instance_name = var.pool.name
  target_size        = var.pool.replicas

  # GPUs are scarce: let the group use whichever zones have them.
  distribution_policy_zones        = var.pool.zones
  distribution_policy_target_shape = "ANY"

  version {
    instance_template = google_compute_instance_template.worker.id
  }

  named_port {
    name = "vllm"
    port = var.pool.engine_port
  }

  auto_healing_policies {
    health_check = google_compute_health_check.engine.id
    # Installing vLLM and downloading the weights comes before the first /health.
    initial_delay_sec = var.pool.boot_s
  }

  # A new template (new vLLM, new model args) is rolled out deliberately, with the
  # surge you can afford: gcloud compute instance-groups managed rolling-action replace.
  update_policy {
    type                         = "OPPORTUNISTIC"
    minimal_action               = "REPLACE"
    instance_redistribution_type = "NONE"
  }
}

output "instance_group" {
  description = "The pool's instance group URL."
  value       = google_compute_region_instance_group_manager.pool.instance_group
}

output "name" {
  description = "The pool's instance group manager name."
  value       = google_compute_region_instance_group_manager.pool.name
}
