# The global entry point: one anycast IP (global external Application Load Balancer).
# A client reaches the nearest Google front end, which sends the request to the closest
# region whose routers are healthy and have room; that router then routes it by predicted
# time to first token, to its own region's GPUs or another's.

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

variable "domain" {
  description = "The API's host name (a Google-managed certificate is issued for it)."
  type        = string
}

variable "router_groups" {
  description = "Router instance group URLs by region name."
  type        = map(string)
}

variable "port" {
  description = "The routers' port (named port \"http\" on every group)."
  type        = number
}

variable "health_path" {
  description = "The routers' readiness endpoint: 503 while a replica cannot route (no view of the fleet, its collector down, fail static past its bound)."
  type        = string
  default     = "/ready"
}

variable "timeout_s" {
  description = "Longest answer, first byte to last (streams included)."
  type        = number
}

variable "dns_zone_name" {
  description = "A public Cloud DNS zone that holds the domain; null: point the domain at the IP yourself."
  type        = string
  default     = null
}

variable "log_sample_rate" {
  description = "Share of requests logged by the load balancer."
  type        = number
  default     = 0.1
}

resource "google_compute_global_address" "api" {
  project = var.project_id
  name    = "${var.name_prefix}-api"
}

resource "google_compute_health_check" "routers" {
  project             = var.project_id
  name                = "${var.name_prefix}-lb-routers"
  check_interval_sec  = 5
  timeout_sec         = 3
  healthy_threshold   = 2
  unhealthy_threshold = 2

  http_health_check {
    port         = var.port
    request_path = var.health_path
  }

  log_config {
    enable = true
  }
}

resource "google_compute_backend_service" "routers" {
  project                         = var.project_id
  name                            = "${var.name_prefix}-routers"
  load_balancing_scheme           = "EXTERNAL_MANAGED"
  protocol                        = "HTTP"
  port_name                       = "http"
  timeout_sec                     = var.timeout_s
  connection_draining_timeout_sec = 60
  health_checks                   = [google_compute_health_check.routers.id]

  dynamic "backend" {
    for_each = var.router_groups
    content {
      group           = backend.value
      balancing_mode  = "UTILIZATION"
      max_utilization = 0.8
      capacity_scaler = 1.0
    }
  }

  log_config {
    enable      = true
    sample_rate = var.log_sample_rate
  }
}

resource "google_compute_url_map" "api" {
  project         = var.project_id
  name            = "${var.name_prefix}-api"
  default_service = google_compute_backend_service.routers.id
}

resource "google_compute_managed_ssl_certificate" "api" {
  project = var.project_id
  name    = "${var.name_prefix}-api"

  managed {
    domains = [var.domain]
  }
}

resource "google_compute_ssl_policy" "api" {
  project         = var.project_id
  name            = "${var.name_prefix}-api"
  profile         = "MODERN"
  min_tls_version = "TLS_1_2"
}

resource "google_compute_target_https_proxy" "api" {
  project          = var.project_id
  name             = "${var.name_prefix}-api"
  url_map          = google_compute_url_map.api.id
  ssl_certificates = [google_compute_managed_ssl_certificate.api.id]
  ssl_policy       = google_compute_ssl_policy.api.id
}

resource "google_compute_global_forwarding_rule" "https" {
  project               = var.project_id
  name                  = "${var.name_prefix}-api-https"
  load_balancing_scheme = "EXTERNAL_MANAGED"
  ip_protocol           = "TCP"
  port_range            = "443"
  ip_address            = google_compute_global_address.api.address
  target                = google_compute_target_https_proxy.api.id
}

resource "google_dns_record_set" "api" {
  count        = var.dns_zone_name == null ? 0 : 1
  project      = var.project_id
  managed_zone = var.dns_zone_name
  name         = "${trimsuffix(var.domain, ".")}."
  type         = "A"
  ttl          = 300
  rrdatas      = [google_compute_global_address.api.address]
}

output "ip_address" {
  description = "The anycast IP address of the API."
  value       = google_compute_global_address.api.address
}

output "url" {
  description = "The API's base URL (OpenAI clients: base_url = <url>/v1)."
  value       = "https://${trimsuffix(var.domain, ".")}"
}
