# The Redis node of one region (scripts/redis.sh) on a fixed internal address:
# redis-server and a sentinel, TLS only, with AUTH. Together the nodes of all regions are
# one Redis Sentinel group: the sentinels promote a replica when the primary is lost, and
# a node decides its role at each boot by asking them (its initial role only counts when
# none answers, at the deployment's first start).

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
  description = "The region of regions.yaml."
  type        = string
}

variable "cloud_region" {
  description = "The Compute Engine region."
  type        = string
}

variable "node" {
  description = "The topology module's regions[region].redis: name, role (at the first start), zone, machine_type."
  type = object({
    name         = string
    role         = string
    zone         = string
    machine_type = string
  })

  validation {
    condition     = contains(["primary", "replica"], var.node.role)
    error_message = "node.role: primary or replica."
  }
}

variable "host" {
  description = "This node's DNS name in the private zone (the other nodes find it by this name; its certificate carries it)."
  type        = string
}

variable "subnetwork" {
  description = "The region's subnetwork id."
  type        = string
}

variable "service_account" {
  description = "The Redis nodes' service account email."
  type        = string
}

variable "image" {
  description = "Boot image (Ubuntu 24.04 LTS: redis-server 7)."
  type        = string
}

variable "settings" {
  description = "What the start-up script reads (the other nodes' names, the initial primary's, quorum and timings, secret ids, Ops Agent); no secret values."
  type        = any
}

variable "labels" {
  description = "Labels on the machine."
  type        = map(string)
  default     = {}
}

locals {
  startup_script = join("\n", [
    "#!/bin/bash",
    file("${path.module}/../../scripts/lib.sh"),
    file("${path.module}/../../scripts/redis.sh"),
  ])
  settings = merge(var.settings, {
    region    = var.region
    role      = var.node.role
    node_host = var.host
  })
}

resource "google_compute_address" "redis" {
  project      = var.project_id
  name         = var.node.name
  region       = var.cloud_region
  subnetwork   = var.subnetwork
  address_type = "INTERNAL"
}

resource "google_compute_instance" "redis" {
  project                   = var.project_id
  name                      = var.node.name
  zone                      = var.node.zone
  machine_type              = var.node.machine_type
  allow_stopping_for_update = true
  labels                    = merge(var.labels, { globalpool-kind = "redis", globalpool-region = var.region })

  boot_disk {
    initialize_params {
      image = var.image
      size  = 20
      type  = "pd-balanced"
    }
  }

  network_interface {
    subnetwork = var.subnetwork
    network_ip = google_compute_address.redis.address
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

  # Read at boot only: changed settings apply at the next boot, not by a new machine.
  metadata = {
    startup-script         = local.startup_script
    globalpool-settings    = jsonencode(local.settings)
    enable-oslogin         = "TRUE"
    block-project-ssh-keys = "true"
    serial-port-enable     = "false"
  }
}

output "address" {
  description = "The node's internal IP address."
  value       = google_compute_address.redis.address
}

output "initial_role" {
  description = "primary or replica at the deployment's first start (the sentinels move the primary after that)."
  value       = var.node.role
}
