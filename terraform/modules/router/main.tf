# The router replicas of one region: a regional managed instance group of small machines
# running `globalpool router --region R` (scripts/router.sh), autohealed on /health,
# autoscaled on CPU and behind the global load balancer. They are stateless, so updates
# roll with a surge.

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

variable "region" {
  description = "The region of regions.yaml these routers run in."
  type        = string
}

variable "cloud_region" {
  description = "The Compute Engine region."
  type        = string
}

variable "zones" {
  description = "Zones to spread the replicas over (null: the region's zones)."
  type        = list(string)
  default     = null
}

variable "name" {
  description = "Instance group name (from the topology module)."
  type        = string
}

variable "replicas" {
  description = "The fewest router replicas in this region (the autoscaler's minimum)."
  type        = number
}

variable "max_replicas" {
  description = "The most router replicas the autoscaler may run in this region."
  type        = number

  validation {
    condition     = var.max_replicas >= 1
    error_message = "max_replicas: at least 1."
  }
}

variable "cpu_target" {
  description = "The routers' mean CPU utilisation (0-1] the autoscaler keeps them at: above it, it adds replicas."
  type        = number
  default     = 0.6
}

variable "machine_type" {
  description = "Machine type of a router replica."
  type        = string
}

variable "port" {
  description = "The port routers listen on (regions.yaml router.port)."
  type        = number
}

variable "health_path" {
  description = "The routers' liveness endpoint, for autohealing (the load balancer uses /ready)."
  type        = string
  default     = "/health"
}

variable "subnetwork" {
  description = "The region's subnetwork id."
  type        = string
}

variable "service_account" {
  description = "The routers' service account email."
  type        = string
}

variable "image" {
  description = "Boot image (Ubuntu 24.04 LTS: Python 3.12)."
  type        = string
}

variable "regions_yaml" {
  description = "The text of the regions.yaml the routers run with (the topology module's router_regions_yaml), written to /etc/globalpool/regions.yaml."
  type        = string
}

variable "settings" {
  description = "What the start-up script reads (pip spec, Redis host, secret ids, env names); no secret values."
  type        = any
}

variable "labels" {
  description = "Labels on the machines."
  type        = map(string)
  default     = {}
}

locals {
  startup_script = join("\n", [
    "#!/bin/bash",
    file("${path.module}/../../scripts/lib.sh"),
    file("${path.module}/../../scripts/router.sh"),
  ])
  settings = merge(var.settings, { region = var.region, port = var.port })
  labels   = merge(var.labels, { globalpool-kind = "router", globalpool-region = var.region })
}

resource "google_compute_instance_template" "router" {
  project      = var.project_id
  name_prefix  = "${var.name}-"
  machine_type = var.machine_type
  labels       = local.labels

  disk {
    source_image = var.image
    disk_size_gb = 20
    disk_type    = "pd-balanced"
    boot         = true
    auto_delete  = true
  }

  network_interface {
    subnetwork = var.subnetwork
  }

  service_account {
    email  = var.service_account
    scopes = ["cloud-platform"]
  }

  shielded_instance_config {
    enable_secure_boot          = true
    enable_vtpm                 = true
    enable_integrity_monitoring = true
  }

  metadata = {
    startup-script          = local.startup_script
    globalpool-settings     = jsonencode(local.settings)
    globalpool-regions-yaml = var.regions_yaml
    enable-oslogin          = "TRUE"
    block-project-ssh-keys  = "true"
    serial-port-enable      = "false"
  }

  lifecycle {
    create_before_destroy = true
  }
}

resource "google_compute_health_check" "router" {
  project             = var.project_id
  name                = "${var.name}-hc"
  check_interval_sec  = 5
  timeout_sec         = 3
  healthy_threshold   = 2
  unhealthy_threshold = 3

  http_health_check {
    port         = var.port
    request_path = var.health_path
  }

  log_config {
    enable = true
  }
}

resource "google_compute_region_instance_group_manager" "routers" {
  project                   = var.project_id
  name                      = var.name
  region                    = var.cloud_region
  base_instance_name        = var.name
  distribution_policy_zones = var.zones
  # No target_size: the autoscaler below owns the group's size.

  version {
    instance_template = google_compute_instance_template.router.id
  }

  named_port {
    name = "http"
    port = var.port
  }

  auto_healing_policies {
    health_check      = google_compute_health_check.router.id
    initial_delay_sec = 300
  }

  # New routers first (a surge of at least one per zone), then the old ones go.
  update_policy {
    type                  = "PROACTIVE"
    minimal_action        = "REPLACE"
    max_surge_fixed       = 4
    max_unavailable_fixed = 0
  }
}

# A router's work is CPU (parsing requests, scoring workers, relaying streams), so CPU is
# the signal. A new replica installs and compiles globalpool at boot: the
# autoscaler ignores its CPU for the first five minutes, as autohealing does, and it
# removes at most one replica per ten minutes so that a short lull does not shrink the
# group just before the next burst.
resource "google_compute_region_autoscaler" "routers" {
  project = var.project_id
  name    = var.name
  region  = var.cloud_region
  target  = google_compute_region_instance_group_manager.routers.id

  autoscaling_policy {
    min_replicas    = var.replicas
    max_replicas    = var.max_replicas
    cooldown_period = 300

    cpu_utilization {
      target = var.cpu_target
    }

    scale_in_control {
      time_window_sec = 600
      max_scaled_in_replicas {
        fixed = 1
      }
    }
  }
}

output "instance_group" {
  description = "The routers' instance group URL (a backend of the global load balancer)."
  value       = google_compute_region_instance_group_manager.routers.instance_group
}

output "name" {
  description = "The routers' instance group manager name."
  value       = google_compute_region_instance_group_manager.routers.name
}
