# One global VPC: a subnet per region (ranges from the topology module), Cloud NAT so that
# machines without public addresses can install packages and download weights, firewall
# rules between the kinds of machine by service account, and a private DNS zone in which
# each Redis node has a name (redis-<region>), by which the nodes find each other.

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

variable "name_prefix" {
  description = "Prefix of resource names."
  type        = string
}

variable "regions" {
  description = "Per region: cloud_region, subnet_name and subnet_cidr (the topology module's regions output)."
  type = map(object({
    cloud_region = string
    subnet_name  = string
    subnet_cidr  = string
  }))
}

variable "service_accounts" {
  description = "Service account emails by kind: worker, router, redis."
  type        = map(string)
}

variable "router_port" {
  description = "The port router replicas listen on."
  type        = number
}

variable "engine_port" {
  description = "The port vLLM listens on."
  type        = number
}

variable "enable_iap_ssh" {
  description = "Allow SSH through Identity-Aware Proxy (35.235.240.0/20) to every machine."
  type        = bool
  default     = true
}

locals {
  # Google front ends and health checkers (load balancer traffic and probes).
  google_probe_ranges = ["35.191.0.0/16", "130.211.0.0/22"]
  dns_domain          = "${var.name_prefix}.globalpool.internal."
}

resource "google_compute_network" "this" {
  project                 = var.project_id
  name                    = "${var.name_prefix}-globalpool"
  auto_create_subnetworks = false
  routing_mode            = "GLOBAL"
}

resource "google_compute_subnetwork" "region" {
  for_each                 = var.regions
  project                  = var.project_id
  name                     = each.value.subnet_name
  region                   = each.value.cloud_region
  network                  = google_compute_network.this.id
  ip_cidr_range            = each.value.subnet_cidr
  private_ip_google_access = true

  log_config {
    aggregation_interval = "INTERVAL_5_MIN"
    flow_sampling        = 0.1
    metadata             = "INCLUDE_ALL_METADATA"
  }
}

resource "google_compute_router" "region" {
  for_each = var.regions
  project  = var.project_id
  name     = "${each.value.subnet_name}-nat"
  region   = each.value.cloud_region
  network  = google_compute_network.this.id
}

resource "google_compute_router_nat" "region" {
  for_each                           = var.regions
  project                            = var.project_id
  name                               = "${each.value.subnet_name}-nat"
  router                             = google_compute_router.region[each.key].name
  region                             = each.value.cloud_region
  nat_ip_allocate_option             = "AUTO_ONLY"
  source_subnetwork_ip_ranges_to_nat = "LIST_OF_SUBNETWORKS"

  subnetwork {
    name                    = google_compute_subnetwork.region[each.key].id
    source_ip_ranges_to_nat = ["ALL_IP_RANGES"]
  }

  log_config {
    enable = true
    filter = "ERRORS_ONLY"
  }
}

resource "google_compute_firewall" "lb_to_routers" {
  project                 = var.project_id
  name                    = "${var.name_prefix}-lb-to-routers"
  network                 = google_compute_network.this.id
  description             = "The global load balancer and its health checks reach the routers."
  direction               = "INGRESS"
  source_ranges           = local.google_probe_ranges
  target_service_accounts = [var.service_accounts.router]

  allow {
    protocol = "tcp"
    ports    = [tostring(var.router_port)]
  }
}

resource "google_compute_firewall" "to_engines" {
  project                 = var.project_id
  name                    = "${var.name_prefix}-to-engines"
  network                 = google_compute_network.this.id
  description             = "Routers in every region reach every vLLM server (requests spill across regions)."
  direction               = "INGRESS"
  source_service_accounts = [var.service_accounts.router]
  target_service_accounts = [var.service_accounts.worker]

  allow {
    protocol = "tcp"
    ports    = [tostring(var.engine_port)]
  }
}

resource "google_compute_firewall" "engine_health" {
  project                 = var.project_id
  name                    = "${var.name_prefix}-engine-health"
  network                 = google_compute_network.this.id
  description             = "Autohealing health checks reach vLLM's /health."
  direction               = "INGRESS"
  source_ranges           = local.google_probe_ranges
  target_service_accounts = [var.service_accounts.worker]

  allow {
    protocol = "tcp"
    ports    = [tostring(var.engine_port)]
  }
}

# Redis (6379) and its sentinels (26379), both TLS only: workers and routers ask the
# sentinels for the primary and then use it; the Redis nodes replicate from the primary,
# and their sentinels watch every node and talk to each other, across regions.
resource "google_compute_firewall" "to_redis" {
  project                 = var.project_id
  name                    = "${var.name_prefix}-to-redis"
  network                 = google_compute_network.this.id
  description             = "Workers, routers and the other Redis nodes reach Redis (6379) and its sentinels (26379), over TLS."
  direction               = "INGRESS"
  source_service_accounts = values(var.service_accounts)
  target_service_accounts = [var.service_accounts.redis]

  allow {
    protocol = "tcp"
    ports    = ["6379", "26379"]
  }
}

resource "google_compute_firewall" "iap_ssh" {
  count                   = var.enable_iap_ssh ? 1 : 0
  project                 = var.project_id
  name                    = "${var.name_prefix}-iap-ssh"
  network                 = google_compute_network.this.id
  description             = "SSH through Identity-Aware Proxy only (gcloud compute ssh --tunnel-through-iap)."
  direction               = "INGRESS"
  source_ranges           = ["35.235.240.0/20"]
  target_service_accounts = values(var.service_accounts)

  allow {
    protocol = "tcp"
    ports    = ["22"]
  }
}

resource "google_dns_managed_zone" "internal" {
  project     = var.project_id
  name        = "${var.name_prefix}-globalpool-internal"
  dns_name    = local.dns_domain
  description = "globalpool internal names (the Redis primary)."
  visibility  = "private"

  private_visibility_config {
    networks {
      network_url = google_compute_network.this.id
    }
  }
}

output "network" {
  description = "The VPC's id."
  value       = google_compute_network.this.id
}

output "subnetworks" {
  description = "Subnetwork ids by region name."
  value       = { for name, subnet in google_compute_subnetwork.region : name => subnet.id }
}

output "dns_zone" {
  description = "The private zone's name and domain (with the trailing dot)."
  value = {
    name   = google_dns_managed_zone.internal.name
    domain = local.dns_domain
  }
}
